"""Command line: ``jaxkv`` (the installed console script) or ``python -m jaxkv``.

Commands: ``demo`` (stream frames through a frame cache), ``convert-lingbot``
(upstream lingbot-map weights to a torch-free safetensors file) and ``launch`` (a script
as one JAX process per GPU); ``--help`` on each
lists its flags. A mistake in the flags, a missing extra or an output that cannot be
written is a one-line usage error (exit status 2), reported before anything is built.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys

from jaxkv import demo, launch
from jaxkv.compilation import persistent_cache

EPILOG = """\
Each command has its own --help. Exit status: 0 done, 2 a usage error (one line naming the
flag, reported before anything is built or written), 1 anything else. Docs: docs/cli.md
(every flag, the files each command writes, the extras it needs)."""


def _version() -> str:
    try:
        return importlib.metadata.version("jaxkv")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "(not installed)"


def _prog() -> str:
    return "python -m jaxkv" if os.path.basename(sys.argv[0] or "") in ("__main__.py", "-c", "") else "jaxkv"


def parser() -> tuple[argparse.ArgumentParser, dict]:
    """The command line's parser and its subcommands' parsers ({name: parser})."""
    p = argparse.ArgumentParser(
        prog=_prog(),
        description="jaxkv command line: KV caches for JAX, tried from the shell.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"jaxkv {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    d = sub.add_parser(
        "demo",
        help="stream frames through a frame cache (random K/V, --model, --lingbot)",
        description=demo.__doc__,
        epilog="Docs: docs/cli.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_arguments(d)
    c = sub.add_parser(
        "convert-lingbot",
        help="lingbot-map weights -> a torch-free .safetensors file",
        description="Read upstream lingbot-map weights (a torch .pt checkpoint, needs torch, or a "
        ".safetensors file) and write them with their config as safetensors, which "
        "load_lingbot_checkpoint and `demo --lingbot --checkpoint` read without torch. "
        'Needs the lingbot extra: pip install "jaxkv[lingbot]".',
        epilog="Docs: docs/cli.md.",
    )
    c.add_argument("checkpoint", help="upstream's checkpoint (.pt / .pth / .bin, or .safetensors)")
    c.add_argument("out", help="the .safetensors file to write (its folder must exist; an existing file is replaced)")
    c.add_argument(
        "--height",
        type=int,
        default=None,
        help="frame height in pixels saved in the config (default: the checkpoint's image size)",
    )
    c.add_argument(
        "--width",
        type=int,
        default=None,
        help="frame width in pixels saved in the config (default: the checkpoint's image size)",
    )
    c.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="another LingbotConfig field (JSON value), e.g. --set selected_idx=[0,1,2,3]; repeatable",
    )
    n = sub.add_parser(
        "launch",
        help="run a script as one JAX process per GPU (jax.distributed)",
        description=launch.__doc__,
        epilog="Docs: docs/sharding.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # the script's own flags follow it: none may read as an abbreviated launcher flag
    )
    launch.add_arguments(n)
    return p, {"demo": d, "convert-lingbot": c, "launch": n}


def convert_lingbot(args):
    """``convert-lingbot``: the checks (extras, the checkpoint file, the output, --set), then the
    conversion. ValueErrors name the argument."""
    demo.require("convert-lingbot", ("flax", "safetensors"), 'pip install "jaxkv[lingbot]"')
    from jaxkv.models.lingbot.convert import checkpoint_kind, convert
    from jaxkv.models.lingbot_demo import parse_overrides

    checkpoint_kind(args.checkpoint, arg="checkpoint")
    out = demo.check_output_file("out", args.out, (".safetensors",))
    overrides = parse_overrides(args.set)
    given = [f"--{k}" for k in ("height", "width") if getattr(args, k) is not None]
    for k in ("height", "width"):
        if getattr(args, k) is not None:
            if k in overrides:
                raise ValueError(f"--set {k}: also given as --{k}; give one of them")
            overrides[k] = getattr(args, k)
    given += ["--set"] * bool(args.set)
    try:
        return convert(args.checkpoint, out, arg="checkpoint", **overrides)
    except ValueError as e:  # a config field the flags set, else the checkpoint's own content
        msg = str(e)
        if msg.startswith("checkpoint:"):
            raise
        flag = ", ".join(dict.fromkeys(given)) if given and not msg.startswith("state dict") else "checkpoint"
        raise ValueError(f"{flag}: {msg}") from None


def main(argv=None) -> int:
    p, subs = parser()
    args = p.parse_args(argv)
    try:
        if args.command == "demo":
            demo.run(args)
        elif args.command == "launch":
            return launch.run(args)
        else:
            print(f"wrote {convert_lingbot(args)}")
    except ValueError as e:
        subs[args.command].error(str(e))  # usage and the message, exit status 2: no traceback
    return 0


def cli() -> int:
    """``python -m jaxkv`` and the ``jaxkv`` command: ``main`` with the compilation cache on,
    so a second run loads the steps the first compiled (jaxkv.compilation)."""
    persistent_cache()
    return main()


if __name__ == "__main__":
    sys.exit(cli())
