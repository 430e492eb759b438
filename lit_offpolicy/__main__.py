from lit_offpolicy.cli import main

main()
