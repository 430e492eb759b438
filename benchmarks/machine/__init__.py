"""Against the machine's own limits: peak FLOPs (MFU), a device-to-device copy and the PCIe bus,
float64 arithmetic; the GPU-only checks."""
