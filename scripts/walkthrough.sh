#!/usr/bin/env bash
# The newcomer's path of docs/quickstart.md, run for real in a scratch directory:
#   your own folder of text -> prepare -> train -> Ctrl-C -> resume -> eval -> generate
#   -> export to Hugging Face -> load with transformers.
# Every command is echoed as `$ command` followed by its output, which is what the quick start
# shows. Run it from an activated venv (the one `make test` builds; transformers + torch come
# with the test extras):
#   scripts/walkthrough.sh [WORKDIR]        # default: a new temporary directory
# tests/docs/test_walkthrough.py runs it and checks the output.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${1:-$(mktemp -d -t mspretrain-walkthrough.XXXXXX)}
export GLOG_v=${GLOG_v:-3}  # quiet MindSpore's native logs
STEPS=40                     # a short run of the tiny config
STOP_AT=10                   # "press Ctrl-C" once this step is logged

command -v mspretrain >/dev/null || { echo "error: mspretrain is not on PATH" >&2; echo "hint: activate the venv: . .venv/bin/activate" >&2; exit 2; }
mkdir -p "$WORK/configs"
cp "$ROOT/configs/tiny.toml" "$WORK/configs/"  # so the commands read exactly as in the docs (run from the repo root)
cd "$WORK"
echo "# workdir: $WORK"

show() { printf '\n$ %s\n' "$*"; "$@"; }

# 1. Your own text: a folder of .txt files, documents separated by blank lines. Here: 1,200
#    generated four-line verses, each character preferring a few successors (something to learn).
mkdir -p my-text
python - <<'EOF'
import random

chars = ("春风明月江南山水花落日夜秋云天地人心来去长空白雪青松流年故乡归路远清香红叶梦中千里万家门前桥边"
         "柳色鸟声寒烟孤舟独坐高楼望断相思无限时光何处见君知我不同一生西东北上下古今朝暮雨晴暖冬夏新旧老少")
rng = random.Random(7)
follow = {c: rng.sample(chars, 4) for c in chars}
for part in range(3):
    docs = []
    for i in range(400):
        width, c, lines = (5 if i % 2 else 7), rng.choice(chars), []
        for _ in range(4):
            line = ""
            for _ in range(width):
                line, c = line + c, rng.choice(follow[c])
            lines.append(line)
        docs.append(f"{lines[0]}，{lines[1]}。\n{lines[2]}，{lines[3]}。")
    with open(f"my-text/part{part}.txt", "w", encoding="utf-8") as f:
        f.write("\n\n".join(docs) + "\n")
EOF
show ls my-text
show head -n 5 my-text/part0.txt

# 2. Prepare: clean, train a tokenizer, write shards.
show mspretrain prepare my-text/ --out data --config configs/tiny.toml

# 3. Train, and press Ctrl-C (SIGINT) mid-run: the step finishes, a checkpoint is written.
TRAIN=(mspretrain train --config configs/tiny.toml --data data --run runs/mine "train.max_steps=$STEPS")
printf '\n$ %s\n' "${TRAIN[*]}"
"${TRAIN[@]}" &
pid=$!
until [ -f runs/mine/metrics.jsonl ] && grep -q "\"step\": $STOP_AT," runs/mine/metrics.jsonl; do
  kill -0 "$pid" 2>/dev/null || { echo "error: training ended before step $STOP_AT" >&2; exit 1; }
  sleep 0.1
done
echo "^C"
kill -INT "$pid"
wait "$pid"

show mspretrain checkpoints runs/mine

# 4. Resume: the same command continues from the newest verified checkpoint.
show "${TRAIN[@]}"

# 5. Evaluate, generate, export.
show mspretrain eval runs/mine
show mspretrain generate runs/mine --prompt 春风 --max-new-tokens 24 --seed 1
show mspretrain export runs/mine --format hf --out hf
show ls hf

# 6. Load the export with Hugging Face transformers: the same perplexity on the same windows of
#    the valid split (data/valid.bin is a flat uint16 token array), then a sample.
cat > load_hf.py <<'EOF'
import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

transformers.utils.logging.disable_progress_bar()
tok = AutoTokenizer.from_pretrained("hf")
model = AutoModelForCausalLM.from_pretrained("hf").eval()
print(type(model).__name__, f"{model.num_parameters():,} parameters, vocab {model.config.vocab_size}")

seq_len = 32  # data.seq_len of configs/tiny.toml: windows of 33 tokens, stride 32, as `mspretrain eval` cuts them
tokens = torch.from_numpy(np.fromfile("data/valid.bin", dtype=np.uint16).astype(np.int64))
n = (len(tokens) - 1) // seq_len
windows = torch.stack([tokens[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])  # (n, 33)
with torch.no_grad():
    logits = model(windows[:, :-1]).logits  # (n, 32, vocab)
nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="sum")
print(f"transformers: valid perplexity {torch.exp(nll / (n * seq_len)).item():.3f} over {n * seq_len:,} tokens")

torch.manual_seed(1)
ids = tok("春风", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=24, do_sample=True, temperature=0.8, top_k=50, top_p=0.95)
print("sample:", tok.decode(out[0], skip_special_tokens=True))
EOF
show python load_hf.py
