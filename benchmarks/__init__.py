"""The lab beside the product: kvtier against vLLM (`compare`, with the peer harness `peers/`),
the roofline experiments (`roofline`) and the engine's own experiments (`device`, `preempt`,
`overlap`, `sampler`). Not in the wheel and never imported by `kvtier` (docs/architecture.md
§Shipping): run `python -m benchmarks.<name>` from a git checkout.
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType


def main(module: ModuleType, argv: list[str] | None = None) -> int:
    """Parse `argv` (default: the command line) with the module's `add_arguments`, then `run`."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {module.__spec__.name if module.__spec__ else module.__name__}",
        description=module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(sys.argv[1:] if argv is None else argv)) or 0)
