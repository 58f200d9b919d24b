"""scikit-learn side of scripts/compare_sklearn.sh: MLPClassifier (256, 128), Adam, batch 128 on Fashion-MNIST,
trained one epoch at a time (partial_fit) so the test accuracy after each epoch is known; prints JSON with the
wall time at which the test accuracy first reached the target."""
import gzip, json, sys, time
import numpy as np
from sklearn.neural_network import MLPClassifier

d = sys.argv[1] if len(sys.argv) > 1 else "/usr/share/datasets/fashion-mnist"
target = float(sys.argv[2]) if len(sys.argv) > 2 else 0.885
epochs = int(sys.argv[3]) if len(sys.argv) > 3 else 20

def idx(path, offset):
    with gzip.open(path, "rb") as f:
        return np.frombuffer(f.read(), np.uint8, offset=offset)

xtr = idx(f"{d}/train-images-idx3-ubyte.gz", 16).reshape(-1, 784).astype(np.float32) / 255.0
ytr = idx(f"{d}/train-labels-idx1-ubyte.gz", 8)
xte = idx(f"{d}/t10k-images-idx3-ubyte.gz", 16).reshape(-1, 784).astype(np.float32) / 255.0
yte = idx(f"{d}/t10k-labels-idx1-ubyte.gz", 8)

clf = MLPClassifier(hidden_layer_sizes=(256, 128), solver="adam", batch_size=128, learning_rate_init=1e-3,
                    random_state=0)
t0 = time.perf_counter()
reached, curve = None, []
for epoch in range(epochs):
    clf.partial_fit(xtr, ytr, classes=np.arange(10))
    acc = float((clf.predict(xte) == yte).mean())
    t = time.perf_counter() - t0
    curve.append([epoch + 1, t, acc])
    print(f"sklearn epoch {epoch + 1:2d}  {t:6.1f}s  test accuracy {acc:.4f}", file=sys.stderr)
    if reached is None and acc >= target:
        reached = t
print(json.dumps({"seconds_to_target": reached, "final_accuracy": curve[-1][2], "wall_seconds": curve[-1][1],
                  "curve": curve}))
