"""python -m wan: run the WAN emulator (flags in wan/main.py)."""
import sys

from wan.main import main

sys.exit(main())
