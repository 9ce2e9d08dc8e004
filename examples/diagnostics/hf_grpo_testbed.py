"""A second, independent GRPO loop on the testbed policy in plain HF transformers (a diagnostic, not the product).

``python examples/diagnostics/hf_grpo_testbed.py LR STEPS PROMPTS GENERATIONS [SEED]``

Why: 30 GRPO steps of the project's loop on ``configs/grpo_math_testbed.yaml`` lowered the held-out accuracy instead
of raising it. This loop shares nothing with the project's trainer (no Ray, vLLM or Megatron: HF ``generate`` at
T = 1, group-normalised advantages (r - mean) / (std + 1e-6), the token-level policy-gradient loss
-sum(A * log p * mask) / sum(mask) at ratio 1, torch Adam, grad-norm clip 1.0); only the problems, the prompt
format and the math reward are the project's. If it shows the same drift, the cause is the regime (model, task,
batch, lr), not the project's pipeline. Prints per-step train reward and, every 10 steps, held-out accuracy greedy
and at T = 1 (4 samples per problem) on the recipe's 128 validation problems.
"""

import random
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nemo_rl_spec.algorithms.grpo_setup import load_datasets
from nemo_rl_spec.data.prompts import format_prompt
from nemo_rl_spec.environments.math_env import MathEnvironment
from nemo_rl_spec.models.hf_assets import resolve_model
from nemo_rl_spec.utils.config import load_config

lr = float(sys.argv[1])
steps = int(sys.argv[2])
P = int(sys.argv[3])
N = int(sys.argv[4])
seed = int(sys.argv[5]) if len(sys.argv) > 5 else 0
torch.manual_seed(seed)
random.seed(seed)
torch.set_num_threads(2)
cfg = load_config("configs/grpo_math_testbed.yaml", [])
path = resolve_model("testbed-llama")
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
train, val = load_datasets(cfg)
train = list(train)
val = list(val)
env = MathEnvironment({"num_workers": 1})
sp = cfg.data.system_prompt


def enc(p):
    return format_prompt(tok, sp, p["question"])


pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def gen(prompts, n, greedy):
    ids = [enc(p) for p in prompts]
    L = max(map(len, ids))
    x = torch.tensor([[pad] * (L - len(i)) + i for i in ids])
    am = (x != pad).long()
    for r, i in enumerate(ids):
        am[r, L - len(i) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=x,
            attention_mask=am,
            do_sample=not greedy,
            temperature=1.0 if not greedy else None,
            top_p=None,
            top_k=0 if not greedy else None,
            max_new_tokens=48,
            num_return_sequences=n,
            pad_token_id=pad,
            eos_token_id=tok.eos_token_id,
        )
    return x, out[:, L:]


def score(resp_ids, probs):
    texts = tok.batch_decode(resp_ids, skip_special_tokens=True)
    return env.step(texts, probs), texts


def evaluate():
    model.eval()
    acc = []
    acc1 = []
    for i in range(0, len(val), 64):
        b = val[i : i + 64]
        _, r = gen(b, 1, True)
        s, _ = score(r, b)
        acc.append(s)
        _, r = gen(b, 4, False)
        s, _ = score(r, [p for p in b for _ in range(4)])
        acc1.append(s)
    return f"greedy {float(torch.cat(acc).mean()):.3f} T1 {float(torch.cat(acc1).mean()):.3f}"


opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8)
print("step 0 val", evaluate(), flush=True)
order = list(range(len(train)))
random.shuffle(order)
for step in range(1, steps + 1):
    b = [train[order[(step - 1) * P + k]] for k in range(P)]
    model.eval()
    x, r = gen(b, N, False)
    rew, texts = score(r, [p for p in b for _ in range(N)])
    g = rew.view(P, N)
    adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).flatten()
    # build full sequences: prompt (left-padded, repeated) + response; response mask up to and incl. first eos
    xr = x.repeat_interleave(N, 0)
    seq = torch.cat([xr, r], 1)
    L = xr.shape[1]
    is_eos = r == tok.eos_token_id
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full((r.shape[0],), r.shape[1] - 1))
    rmask = (torch.arange(r.shape[1])[None] <= first[:, None]).float()
    am = torch.cat([(xr != pad).long(), rmask.long()], 1)
    for rr in range(xr.shape[0]):
        npad = int((xr[rr] == pad).sum())
        am[rr, :npad] = 0
        am[rr, npad:L] = 1
    model.train()
    pos = (am.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=seq, attention_mask=am, position_ids=pos).logits[:, L - 1 : -1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, r[..., None]).squeeze(-1)
    loss = -(adv[:, None] * lp * rmask).sum() / rmask.sum()
    opt.zero_grad()
    loss.backward()
    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    line = f"step {step} reward {rew.mean():.3f} len {rmask.sum(1).mean():.1f} gn {gn:.2f}"
    if step % 10 == 0:
        line += f" val {evaluate()}"
    print(line, flush=True)
