"""Command-line client: prints the completion as it arrives; Ctrl-C cancels the request.

    python -m client.cli "Once upon a time" --max-tokens 64 --temperature 0
    python -m client.cli --messages '[{"role": "user", "content": "Hi"}]' --protocol http
"""
from __future__ import annotations

import argparse
import json
import sys

from client.stream import GenerationError, generate

DEFAULT_URLS = {"grpc": "localhost:8001", "http": "localhost:8000"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specserve-client", description=__doc__.splitlines()[0])
    p.add_argument("prompt", nargs="?", help="the prompt (or give --messages)")
    p.add_argument("--messages", help='JSON chat: [{"role": "user", "content": "..."}]')
    p.add_argument("--url", help="server address (default localhost:8001 for grpc, :8000 for http)")
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    p.add_argument("--model", default="llm", help="llm (Ctrl-C sends it a stop request), llm_bls, or llm_engine (token ids in)")
    p.add_argument("--no-stream", dest="stream", action="store_false", help="one response at the end")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--presence-penalty", type=float)
    p.add_argument("--frequency-penalty", type=float)
    p.add_argument("--min-tokens", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", default=None)
    p.add_argument("--echo", action="store_true", help="print the prompt before the completion "
                   "(with --messages, the rendered chat: needs --no-stream)")
    p.add_argument("--sampling-parameters", help="JSON object, vllm_backend style")
    p.add_argument("--logprobs", action="store_true", help="print each token's logprob at the end")
    p.add_argument("--stats", action="store_true", help="print finish reason and token counts")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a response")
    args = p.parse_args(argv)
    if (args.prompt is None) == (args.messages is None):
        p.error("give a prompt or --messages (not both)")
    if args.echo and args.messages is not None and args.stream:
        p.error("--echo with --messages needs --no-stream (the server renders the chat)")
    return args


def _sampling_parameters(args: argparse.Namespace) -> str | None:
    """--sampling-parameters, with `logprobs` 0 (the chosen token's) added for --logprobs."""
    if not args.logprobs:
        return args.sampling_parameters
    values = json.loads(args.sampling_parameters) if args.sampling_parameters else {}
    values.setdefault("logprobs", 0)
    return json.dumps(values)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    params = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        min_tokens=args.min_tokens,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        exclude_input_in_output=not (args.echo and not args.stream),  # streamed: echoed here
        sampling_parameters=_sampling_parameters(args),
        return_logprobs=args.logprobs or None,
        return_finish_reason=args.stats or None,
        return_num_input_tokens=args.stats or None,
        return_num_output_tokens=args.stats or None,
    )
    url = args.url or DEFAULT_URLS[args.protocol]
    logprobs: list[dict] = []
    last, output_tokens = None, 0
    chunks = generate(
        url, args.prompt, args.messages, args.protocol, args.stream, args.model, args.timeout,
        **params,
    )
    if args.echo and args.stream:
        sys.stdout.write(args.prompt)
    try:
        for chunk in chunks:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            logprobs += chunk.logprobs or []
            output_tokens += chunk.num_output_tokens or 0
            last = chunk
    except GenerationError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\n[cancelled]", file=sys.stderr)
        return 130
    finally:
        chunks.close()  # stops the request on the server if it is still running
    print()
    if args.logprobs:
        print(json.dumps(logprobs), file=sys.stderr)
    if args.stats and last is not None:
        print(
            f"[finish_reason={last.finish_reason} input_tokens={last.num_input_tokens} "
            f"output_tokens={output_tokens}]",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
