"""check.py's ``piecewise`` call on the attention side: AFD's piecewise CUDA graphs without vLLM's compiler.

Two layers of [piece: matmul + RMS norm] -> ``afd::exchange`` -> [piece: residual add], each piece captured
once in a ``torch.cuda.CUDAGraph`` and replayed around the eager exchange, per token count; on CPU the pieces
run eagerly (the script's self-test). check.py's docstring says what the call checks.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def piecewise_sizes(conn: Any, opts: dict[str, Any], device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Per size: two layers, pieces captured in CUDA graphs (eager on CPU), the exchange between them."""
    from afd_patches.models import exchange_op
    from afd_patches.models.link import AfdLink

    hidden = opts["hidden"]
    link = AfdLink(2, hidden, dtype)
    link.connector = conn
    gen = torch.Generator().manual_seed(11)
    weight = (torch.randn(hidden, hidden, generator=gen) * hidden ** -0.5).to(device, dtype)

    def pre(h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(h @ weight.t(), (hidden,))

    def post(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return h + y

    results = []
    for tokens in opts["tokens"]:
        x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
        with torch.inference_mode():
            link.begin_step()
            h = x
            for layer in range(2):
                h = post(h, exchange_op.exchange(pre(h), link.op_id, layer))
            reference = h.clone()
            h_in, y_in = torch.zeros_like(x), torch.zeros_like(x)
            graphs = device.type == "cuda"
            if graphs:
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    for _ in range(2):
                        pre(h_in), post(h_in, y_in)  # warm-up before capture, as torch documents
                torch.cuda.current_stream(device).wait_stream(side)
                g_pre, g_post = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                with torch.cuda.graph(g_pre):
                    a_out = pre(h_in)
                with torch.cuda.graph(g_post):
                    h_out = post(h_in, y_in)
            link.begin_step()
            h_in.copy_(x)
            t0 = time.perf_counter()
            for layer in range(2):
                if graphs:
                    g_pre.replay()
                else:
                    a_out = pre(h_in)
                y_in.copy_(exchange_op.exchange(a_out, link.op_id, layer))
                if graphs:
                    g_post.replay()
                else:
                    h_out = post(h_in, y_in)
                h_in.copy_(h_out)
            if graphs:
                torch.cuda.synchronize(device)
            step_us = (time.perf_counter() - t0) * 1e6
        results.append({"tokens": tokens, "hidden": hidden, "dtype": opts["dtype"], "cuda_graphs": graphs,
                        "bitwise_equal": bool(torch.equal(h_in, reference)), "step_us": step_us,
                        "exchanges": link.exchanges})
    return results
