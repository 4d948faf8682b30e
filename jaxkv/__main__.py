"""Command line: ``python -m jaxkv demo --help``, ``python -m jaxkv convert-lingbot --help``."""

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
    c = sub.add_parser("convert-lingbot", help="upstream lingbot-map weights -> a torch-free .safetensors file",
                       description="Read upstream lingbot-map weights (a torch .pt pickle, needs torch, or a "
                                   ".safetensors file) and write them with their config as safetensors, which "
                                   "load_lingbot_checkpoint and `demo --lingbot --checkpoint` read without torch.")
    c.add_argument("checkpoint", help="upstream's checkpoint (.pt / .pth / .bin / .safetensors)")
    c.add_argument("out", help="the .safetensors file to write")
    c.add_argument("--height", type=int, default=None, help="frame height in pixels saved in the config")
    c.add_argument("--width", type=int, default=None, help="frame width in pixels saved in the config")
    c.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="another LingbotConfig field (JSON value), e.g. --set selected_idx=[0,1,2,3]; repeatable")
    args = p.parse_args(argv)
    if args.command == "demo":
        try:
            demo.check_args(args)
            demo.run(args)
        except ValueError as e:
            d.error(str(e))  # usage and the message, exit status 2: no traceback
    elif args.command == "convert-lingbot":
        try:
            from jaxkv.models.lingbot.convert import convert
            from jaxkv.models.lingbot_demo import parse_overrides
        except ImportError as e:
            c.error(f"needs flax and safetensors ({e})")
        try:
            overrides = parse_overrides(args.set)
            overrides.update({k: getattr(args, k) for k in ("height", "width") if getattr(args, k) is not None})
            out = convert(args.checkpoint, args.out, **overrides)
        except ValueError as e:
            c.error(str(e))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
