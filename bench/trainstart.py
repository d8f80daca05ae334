"""The training-start script the benchmark image runs (copied to /app/train.py).

What a real job does before its first step: import torch, build the model
from its config, load the first weight shard. Every phase prints a
`PHASE name epoch-seconds` line (the host shares the clock, so the benchmark
can lay the phases on its own timeline) and the last line is `READY` with the
bytes the process read from storage (/proc/self/io), which on a local disk
with a cold page cache is what the start needs from the image.

Standard library and torch only: it runs inside the image, not in the venv.
"""

import json
import struct
import sys
import time

MODEL_DIR = "/models/demo"


def mark(phase: str) -> None:
    print(f"PHASE {phase} {time.time():.6f}", flush=True)


def load_safetensors(path: str) -> dict:
    import torch

    dtypes = {"F16": torch.float16, "F32": torch.float32, "BF16": torch.bfloat16}
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        data = bytearray(f.read())
    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        flat = torch.frombuffer(data, dtype=dtypes[meta["dtype"]], count=(end - start) // 2, offset=start)
        tensors[name] = flat.reshape(meta["shape"])
    return tensors


def main() -> None:
    mark("interpreter")
    import torch
    from torch import nn

    mark("import_torch")
    with open(f"{MODEL_DIR}/config.json") as f:
        config = json.load(f)
    layer = nn.TransformerEncoderLayer(
        config["hidden_size"],
        config["num_heads"],
        config["intermediate_size"],
        batch_first=True,
    )
    model = nn.TransformerEncoder(layer, config["num_layers"], enable_nested_tensor=False)
    mark("build_model")
    shard = load_safetensors(f"{MODEL_DIR}/{config['shards'][0]}")
    loaded = sum(t.numel() for t in shard.values())
    mark("load_shard")
    with torch.no_grad():
        model(torch.zeros(1, 8, config["hidden_size"]))
    with open("/proc/self/io") as f:
        io = dict(line.split(": ") for line in f.read().splitlines())
    params = sum(p.numel() for p in model.parameters())
    print(
        f"READY params={params} shard_elements={loaded} read_bytes={io['read_bytes'].strip()}",
        flush=True,
    )
    sys.exit(0)


if __name__ == "__main__":
    main()
