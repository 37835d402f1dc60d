"""`make demo`: serve the embedded SmolLM2-135M-Instruct with `pagoda serve`, ask it one question
through the official `openai` client, print the answer and the commands to do it yourself, stop.

    python -m pagoda.demo
"""

from __future__ import annotations

import json
import shlex
import sys
import time

QUESTION = "What is the capital of France?"


def main() -> int:
    import openai

    from pagoda.service.serve_process import ServeProcess

    print("Starting `pagoda serve` on the embedded SmolLM2-135M-Instruct (CPU: loading takes ~20 s) ...")
    server = ServeProcess(["--served-model-name", "smollm2"])
    started = time.monotonic()
    try:
        server.start()
    except (RuntimeError, TimeoutError) as exc:
        print(f"pagoda serve did not start: {exc}", file=sys.stderr)
        return 1
    try:
        elapsed = time.monotonic() - started
        print(f"Ready in {elapsed:.0f} s at {server.base_url} (gRPC on {server.grpc_target}).")
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=48
        )
        answer = (reply.choices[0].message.content or "").strip()
        print(f"\nQ: {QUESTION}\nA: {answer}\n")
        usage = reply.usage
        if usage is not None:
            print(f"({usage.prompt_tokens} prompt tokens, {usage.completion_tokens} generated)\n")
    finally:
        exit_code = server.stop()
    print("Run it yourself:")
    print("  .venv/bin/pagoda serve --served-model-name smollm2   # --model DIR_OR_GGUF for another model")
    body = {"model": "smollm2", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0}
    print(
        "  curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' -d "
        + shlex.quote(json.dumps(body))
    )
    print("  curl -s localhost:8000/metrics | grep ^pagoda_")
    if exit_code != 0:
        print(f"pagoda serve exited with {exit_code}:\n{server.log()[-2000:]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
