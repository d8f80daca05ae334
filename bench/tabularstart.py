"""The tabular image's start script (copied to /app/train.py).

What a tabular training job does before its first step: import pandas,
pyarrow and scikit-learn (which imports scipy), build its preprocessing and
models from the dataset's config, load the first parquet shard, fit a linear
model and a small booster on one minibatch and score the next. Its imports
open many small modules and extensions across many packages, where the
torch start reads a few large libraries.

It prints the phase marks bench/trainstart.py prints, under the same names,
so the benchmark's timeline parses both: `import_torch` ends the imports,
`build_model` the pipeline, `load_shard` the shard's load; READY follows
the first fit and prediction, with the bytes the process read from storage.

Standard library and the image's packages only: it runs inside the image.
"""

import json
import sys
import time

DATA_DIR = "/datasets/demo"
BATCH_ROWS = 4096


def mark(phase: str) -> None:
    print(f"PHASE {phase} {time.time():.6f}", flush=True)


def main() -> None:
    mark("interpreter")
    import numpy as np
    import pandas as pd
    import pyarrow.parquet as pq
    from sklearn.compose import ColumnTransformer
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.linear_model import SGDClassifier
    from sklearn.metrics import roc_auc_score
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    mark("import_torch")
    with open(f"{DATA_DIR}/config.json") as f:
        config = json.load(f)
    features = ColumnTransformer(
        [
            ("numeric", StandardScaler(), config["numeric"]),
            ("categorical", OneHotEncoder(handle_unknown="ignore"), config["categorical"]),
        ],
        sparse_threshold=0,  # dense: the booster takes no sparse input
    )
    models = {
        "sgd": SGDClassifier(loss="log_loss", random_state=0),
        "booster": HistGradientBoostingClassifier(max_iter=5, random_state=0),
    }
    mark("build_model")
    path = f"{DATA_DIR}/{config['shards'][0]}"
    frame = pd.read_parquet(path)
    rows = pq.ParquetFile(path).metadata.num_rows
    mark("load_shard")
    # The first step: one minibatch to fit on, the next to score.
    train, test = train_test_split(frame.iloc[: 2 * BATCH_ROWS], test_size=0.5, random_state=0)
    x_train, x_test = features.fit_transform(train), features.transform(test)
    y_train, y_test = train[config["label"]], test[config["label"]]
    models["sgd"].partial_fit(x_train, y_train, classes=np.array([0, 1]))
    models["booster"].fit(x_train, y_train)
    auc = {name: roc_auc_score(y_test, m.predict_proba(x_test)[:, 1]) for name, m in models.items()}
    with open("/proc/self/io") as f:
        io = dict(line.split(": ") for line in f.read().splitlines())
    scored = " ".join(f"auc_{name}={value:.3f}" for name, value in auc.items())
    print(f"READY rows={rows} {scored} read_bytes={io['read_bytes'].strip()}", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
