"""Command line: ``python -m jaxkv demo --help``."""

from __future__ import annotations

import argparse
import sys

from jaxkv import demo


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxkv", description="jaxkv command line")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="stream random frames through a lingbot-map-shaped frame cache",
                       description=demo.__doc__)
    demo.add_arguments(d)
    args = p.parse_args(argv)
    if args.command == "demo":
        try:
            demo.check_args(args)
        except ValueError as e:
            d.error(str(e))  # usage and the message, exit status 2: no traceback
        demo.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
