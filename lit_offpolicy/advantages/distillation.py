"""On-policy distillation's per-token advantage: the student samples, a frozen teacher scores each
sampled token, and the advantage rewards the tokens the teacher finds likelier than the student does.

    A_t = task_coef · A_t^task − coef · (log π_student(y_t | x, y_<t) − log π_teacher(y_t | x, y_<t))

The bracket is the single-sample estimate of the reverse KL(π_student ‖ π_teacher) at token t (k1);
its policy-gradient minimises that KL on the student's own samples (Agarwal et al. 2024, GKD,
arXiv:2306.13649; Lu and Thinking Machines Lab 2025, "On-Policy Distillation"). π_student is π_old,
the policy the step's tokens are trained against (π_rollout in bypass mode); padding gets 0.
"""

from __future__ import annotations

from torch import Tensor

from lit_offpolicy.core.masked import masked_mean, zero_padding


def distillation_advantages(
    task_advantages: Tensor,
    student_log_probs: Tensor,
    teacher_log_probs: Tensor,
    response_mask: Tensor,
    coef: float = 1.0,
    task_coef: float = 1.0,
) -> Tensor:
    """(B, R) ``task_coef`` · ``task_advantages`` − ``coef`` · (log π_student − log π_teacher); 0 on
    padding."""
    gap = student_log_probs - teacher_log_probs
    return zero_padding(task_coef * task_advantages - coef * gap, response_mask)


def reverse_kl(student_log_probs: Tensor, teacher_log_probs: Tensor, response_mask: Tensor) -> Tensor:
    """The mean over response tokens of log π_student − log π_teacher: ``distill/reverse_kl``."""
    return masked_mean(student_log_probs - teacher_log_probs, response_mask)
