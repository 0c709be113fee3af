"""`python -m lora_lab ...` is the `lora-lab` command (for machines where the package is on PYTHONPATH only)."""
from lora_lab.lab.cli import main

raise SystemExit(main())
