"""The ``vitkit`` command line: the table of contents. Each command group lives in ``vitkit.commands.<group>``
(``add_parser(sub)`` registers its subcommands) and wires arguments to the public Python API.

Errors in the user's input (files, options, checkpoints) end with one line on stderr naming the cause,
and exit status 2; no tracebacks.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from vitkit.commands import bench, demo, embed, evaluate, hub, model, predict, search, serve, train
from vitkit.commands.args import Parser
from vitkit.errors import VitkitError
from vitkit.textids import printable
from vitkit.version import __version__

COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    model.add_parser,  # info, convert, export
    predict.add_parser,  # predict
    train.add_parser,  # train, finetune
    evaluate.add_parser,  # eval, fewshot, knn, analyze
    embed.add_parser,  # embed
    search.add_parser,  # index, search, dedup
    bench.add_parser,  # bench
    hub.add_parser,  # download, models
    serve.add_parser,  # serve
    demo.add_parser,  # demo
]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="vitkit",
        description="Vision Transformers (Dosovitskiy et al., ICLR 2021): train, fine-tune, evaluate, analyse, "
        "convert. Run 'vitkit COMMAND --help' for each command.",
    )
    parser.add_argument("--version", action="version", version=f"vitkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for add in COMMANDS:
        add(sub)
    parser.set_defaults(commands=sub.choices)  # the subcommands' parsers, for their own errors (parse)
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, but arguments a subcommand does not know are its error ("vitkit eval: error: ...",
    with its --help), not the top-level parser's ("vitkit: error: ...")."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        owner = args.commands.get(args.command, parser)  # no command: the top-level parser
        owner.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse(parser, argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except VitkitError as e:
        error = str(e)
    except BrokenPipeError:  # the reader went away (vitkit info B/16 --json | head -1): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush cannot fail again
        return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by a closed pipe
    except OSError as e:  # the disk or file system said no (full, read-only, a file where a folder goes...)
        error = (f"{e.filename}: " if e.filename else "") + str(e.strerror or e)
    except MemoryError as e:  # an allocation no check foresaw (inputs are checked before they are allocated)
        error = f"out of memory ({str(e) or 'MemoryError'})"
    except KeyboardInterrupt:
        print(f"vitkit {args.command}: interrupted", file=sys.stderr)
        return 130
    print(f"vitkit {args.command}: error: {printable(error)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
