"""`specfleet train-draft`: an EAGLE head or Medusa heads for a target model, in four stages that each resume.

    distill   the engine answers the training prompts (batched; a mix of greedy and sampled answers),
              so the head learns the target's own distribution, not a dataset's
    features  one target forward over each prompt + answer: the features of the head's layers at
              every position, and the target's top next tokens with their probabilities (the labels)
    train     the head, on those, with a progress line and a loss curve; each step unrolls the
              head on its own outputs (EAGLE-3's training-time test), as it drafts when serving;
              Medusa (`--method medusa`): the sum over heads of each one's cross-entropy on the
              answer's tokens, head i's weighted 0.8^i
    eval      the head drafts for held-back prompts in the real engine: acceptance by draft
              position and tau (tokens per verify step), greedy output checked against plain
              decoding; a PNG of the loss and the acceptance

Output (`--out DIR`): `config.json` + `head.safetensors` (draft_head.py, medusa_head.py), what `draft.uri` loads;
the stages' files under DIR/work (a stage whose file is complete is skipped on a rerun; distill
and train resume where they stopped)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from specfleet_api import limits
from specfleet_api.enums import DEVICES, Method

from .draft_head import EagleHead, HeadConfig, load_head, save_head
from .medusa_head import DEFAULT_HEADS, MedusaConfig, MedusaHead, load_medusa_head
from .engine import Engine
from .kv_cache import BlockTable, PagedKVCache, batch_metadata
from .sampling import SamplingParams

STAGES = ("distill", "features", "train", "eval")
TINY = "tiny-random"


@dataclass
class TrainArgs:
    target: str
    prompts: str
    out: str
    method: str = "eagle"
    device: str = "cpu"
    dtype: str = "fp32"
    quantization: str = "none"  # of the target while it answers (features always come from `dtype`)
    train_prompts: int = 1200
    eval_prompts: int = 32
    max_prompt_tokens: int = 256  # longer prompts are left out
    max_new_tokens: int = 128
    batch: int = 16  # answers decoded together
    sampled_share: float = 0.5  # of the answers, sampled (the rest greedy: the gRPC API's default)
    temperature: float = limits.OPENAI_DEFAULT_TEMPERATURE  # of the sampled ones (the OpenAI API's default)
    draft_vocab: int = 4096
    epochs: float = 2.0
    lr: float = 1e-3
    unroll: int = 2  # draft steps a training row unrolls (EAGLE)
    heads: int = DEFAULT_HEADS  # Medusa's
    train_batch: int = 8  # sequences an optimizer step
    prompt_weight: float = 0.0  # EAGLE: of a prompt row's loss against an answer row's (0: answers only)
    val_share: float = 0.02  # of the distilled answers, held out of training: the teacher-forced check
    train_share: float = 1.0  # of the rest, trained on (less: how the head scales with its data)
    top_k_labels: int = 8
    seed: int = 0
    threads: int = 0
    eval_k: int = 5
    stages: tuple[str, ...] = STAGES


def log(msg: str) -> None:
    print(msg, flush=True)


# -- the target --------------------------------------------------------------------------------

def load_target(name: str, dtype: str = "fp32", quantization: str = "none", device: str = "cpu"):
    """(model, tokenizer) for a model name or path; `tiny-random` is the tests' random model with
    its character tokenizer (the worker serves the same one)."""
    if name == TINY:
        from .testing import CharTokenizer, tiny_model
        return tiny_model(seed=0, scale=4.0), CharTokenizer()
    from .factory import device_of, prepare_model
    from .loader import load_tokenizer
    return prepare_model(name, dtype, quantization, device=device_of(device)), load_tokenizer(name)


def read_prompts(path: str | Path) -> list[str]:
    """JSON lines with `prompt` (or Spec-Bench's `turns`): the texts, in file order; ValueError
    naming the line that has neither."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        text = row.get("prompt") or (row.get("turns") or [None])[0]
        if not isinstance(text, str) or not text:
            raise ValueError(f"{path}:{n}: no `prompt` (or `turns`) text")
        out.append(text)
    return out


def split_prompts(prompts: list[str], n_train: int, n_eval: int, seed: int) -> tuple[list[int], list[int]]:
    """Indices of the held-back eval prompts and of the training prompts: a seeded shuffle, eval first."""
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    return order[n_eval:n_eval + n_train], order[:n_eval]


# -- stage 1: self-distillation --------------------------------------------------------------

def distill(a: TrainArgs, work: Path, model, tokenizer, prompts: list[str], train_ids: list[int]) -> Path:
    """Appends {i, prompt, output, sampled} per answered prompt to work/distill.jsonl; resumes."""
    path = work / "distill.jsonl"
    done = {json.loads(line)["i"] for line in path.read_text().splitlines()} if path.exists() else set()
    todo = []
    for i in train_ids:
        if i in done:
            continue
        ids = tokenizer.chat(prompts[i])
        if 0 < len(ids) <= a.max_prompt_tokens:
            todo.append((i, ids))
    if not todo:
        log(f"[distill] {len(done)} answers on file: done")
        return path
    engine = Engine(model, tokenizer, proposers={}, max_kv_tokens=a.batch * (a.max_prompt_tokens + a.max_new_tokens + 16))
    t0, tokens = time.perf_counter(), 0
    with path.open("a") as f:
        for lo in range(0, len(todo), a.batch):
            chunk = todo[lo:lo + a.batch]
            seqs = []
            for i, ids in chunk:
                sampled = random.Random(a.seed * 1_000_003 + i).random() < a.sampled_share
                params = SamplingParams(max_tokens=a.max_new_tokens, seed=i,
                                        temperature=a.temperature if sampled else limits.WIRE_DEFAULT_TEMPERATURE)
                seqs.append((i, ids, sampled, engine.add(ids, params, "none", 0)))
            while not all(s.finished for *_, s in seqs):
                engine.step()
            for i, ids, sampled, s in seqs:
                f.write(json.dumps({"i": i, "prompt": ids, "output": s.output, "sampled": sampled}) + "\n")
                tokens += len(s.output)
            f.flush()
            n = min(lo + a.batch, len(todo))
            rate = tokens / (time.perf_counter() - t0)
            eta = (len(todo) - n) / n * (time.perf_counter() - t0)
            log(f"[distill] {len(done) + n}/{len(done) + len(todo)} prompts answered, {tokens} tokens, "
                f"{rate:.0f} tokens/s, about {eta / 60:.1f} min left")
    return path


def read_distilled(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- stage 2: the target's features and labels ------------------------------------------------

def target_pass(model, layers: tuple[int, ...], seqs: list[list[int]], top_k: int):
    """One target forward over whole sequences: per sequence its features [n, len(layers) * dim]
    and its top next tokens after each position (ids [n, k], probabilities [n, k])."""
    cache = PagedKVCache.for_model(model.args, sum(map(len, seqs)) + 16 * len(seqs), 16, dtype=model.dtype,
                                   device=model.device)
    tables = [BlockTable(cache) for _ in seqs]
    tokens, meta, _ = batch_metadata(tables, seqs)
    with torch.inference_mode():
        logits, feats = model(tokens, meta, cache.layers, None, features=layers)
        top = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
    out, at = [], 0
    for s in seqs:
        n = len(s)
        # clones made outside inference mode: tensors autograd may read (training)
        out.append((feats[at:at + n].cpu().clone(), top.indices[at:at + n].cpu().clone(),
                    top.values[at:at + n].cpu().clone()))
        at += n
    return out


def extract_features(a: TrainArgs, work: Path, model, layers: tuple[int, ...], rows: list[dict]) -> Path:
    """work/features.safetensors: per row r, f{r} (bf16), top{r} (int32), p{r} (fp16)."""
    from safetensors.torch import save_file
    path = work / "features.safetensors"
    if path.exists():
        log(f"[features] {path} on file: done")
        return path
    tensors, t0, total = {}, time.perf_counter(), 0
    batch, budget = [], 2048  # tokens a forward
    for r, row in enumerate(rows):
        batch.append(r)
        if sum(len(rows[b]["prompt"]) + len(rows[b]["output"]) for b in batch) >= budget or r == len(rows) - 1:
            seqs = [rows[b]["prompt"] + rows[b]["output"] for b in batch]
            for b, (f, ids, p) in zip(batch, target_pass(model, layers, seqs, a.top_k_labels)):
                tensors[f"f{b}"] = f.to(torch.bfloat16).contiguous()
                tensors[f"top{b}"] = ids.to(torch.int32).contiguous()
                tensors[f"p{b}"] = p.to(torch.float16).contiguous()
            total += sum(map(len, seqs))
            batch = []
            log(f"[features] {r + 1}/{len(rows)} sequences, {total} tokens, "
                f"{total / (time.perf_counter() - t0):.0f} tokens/s")
    tmp = path.with_suffix(".partial")
    save_file(tensors, str(tmp))
    tmp.rename(path)  # complete or absent
    return path


# -- stage 3: training -----------------------------------------------------------------------

def draft_vocabulary(rows: list[dict], size: int, vocab_size: int, always: list[int]) -> torch.Tensor:
    """The `size` target tokens the answers hold most (the stop tokens always), ids ascending."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in rows:
        counts += torch.bincount(torch.tensor(row["output"] or [0], dtype=torch.long), minlength=vocab_size)
    counts[torch.tensor(always, dtype=torch.long)] = counts.max() + 1
    return torch.sort(counts.topk(min(size, vocab_size)).indices).values


def attends(step: Tensor, t: Tensor, step_c: Tensor, t_c: Tensor) -> Tensor:
    """Which training rows may attend to which: rows (step, t) [R] against columns (step_c, t_c)
    [C] -> bool [R, C]. Row (j, t), step j = 1..unroll, reads the token at t + 1 and predicts the
    one at t + 2: at step 1 from the target's features at t; at step j > 1 from its own output at
    (j - 1, t - 1), as when it drafts. It sees what it would see when drafting: step-1 rows up to
    t - j + 1 (the target's features) and its own chain (i, t - j + i) for i = 2..j."""
    j, t, jc, tc = step[:, None], t[:, None], step_c[None, :], t_c[None, :]
    return ((jc == 1) & (tc <= t - j + 1)) | ((jc >= 2) & (jc <= j) & (tc - jc == t - j))


def unrolled_rows(n: int, unroll: int) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """All rows (j, t) of one sequence of n tokens unrolled `unroll` draft steps, and their mask
    (see `attends`).

    >>> rows, mask = unrolled_rows(3, 2)  # pairs t = 0, 1 at step 1; t = 1 at step 2
    >>> rows, mask.int().tolist()
    ([(1, 0), (1, 1), (2, 1)], [[1, 0, 0], [1, 1, 0], [1, 0, 1]])
    """
    rows = [(j, t) for j in range(1, unroll + 1) for t in range(j - 1, n - 1)]
    step, t = torch.tensor([r[0] for r in rows], dtype=torch.long), torch.tensor([r[1] for r in rows], dtype=torch.long)
    return rows, attends(step, t, step, t)


def sequence_loss(head: EagleHead, embeddings, row: dict, feats: torch.Tensor, top: torch.Tensor, probs: torch.Tensor,
                  vocab_row: torch.Tensor, unroll: int, prompt_weight: float = 0.0,
                  prompt_from: int = 0) -> tuple[torch.Tensor, list[float], list[float]]:
    """The loss of one sequence (soft cross-entropy against the target's top tokens, over the draft
    vocabulary, on the answer's positions), and per unroll step its loss and the share of rows
    whose top draft token is the target's top token, both on the answer's rows.

    With `prompt_weight` > 0 the rows that predict the prompt's tokens past position `prompt_from`
    (the chat template's common prefix) count too, each weighing `prompt_weight` against an
    answer row's 1: the target's labels there come from the same forward, so they are more
    training rows for no more distilling.

    One pass per draft step over the rows that step needs (the rows of `unrolled_rows`, each once):
    step 1 adds every position's keys and values (the target's features all rows attend to) and
    runs the rest of the layer only where the answer, or a later step's parent, needs it; step j
    runs the rows whose chain ends in the answer, attending to the keys and values so far."""
    seq = row["prompt"] + row["output"]
    n, first = len(seq), max(0, len(row["prompt"]) - 2)  # rows t >= first predict answer tokens
    start = min(first, max(0, prompt_from - 1)) if prompt_weight > 0 else first  # the first row with a loss
    emb_all = embeddings(torch.tensor(seq)).float()
    fused = head.fused(feats.float())  # [n, dim]
    total, losses, hits = 0.0, [], []
    past, hidden_prev, lo_prev = None, None, 0
    col_step, col_t = torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    for j in range(1, unroll + 1):
        lo = max(j - 1, start - (unroll - j))  # the first t whose row step j needs
        if lo > n - 2:
            losses.append(0.0)
            hits.append(0.0)
            continue
        if j == 1:
            t_rows = torch.arange(0, n - 1)
            feature = fused[: n - 1]
            queries = torch.arange(lo, n - 1)
        else:
            t_rows = torch.arange(lo, n - 1)
            feature = hidden_prev[t_rows - 1 - lo_prev]  # the parent (j - 1, t - 1)
            queries = None
        col_step = torch.cat([col_step, torch.full_like(t_rows, j)])
        col_t = torch.cat([col_t, t_rows])
        t_q = t_rows[lo - t_rows[0]:]
        mask = attends(torch.full_like(t_q, j), t_q, col_step, col_t)
        hidden, past = head.forward_dense(emb_all[t_rows + 1], feature, t_rows, mask, past, queries)
        hidden_prev, lo_prev = hidden, lo
        use = (t_q >= start).nonzero().flatten()
        if len(use) == 0:
            losses.append(0.0)
            hits.append(0.0)
            continue
        logits = head.logits(hidden[use])
        tt = t_q[use] + 1  # the target's distribution after position t + 1
        label_rows = vocab_row[top[tt].long()]  # [m, k] draft-vocabulary rows, -1 off it
        p = probs[tt].float() * (label_rows >= 0)
        picked = torch.log_softmax(logits, dim=-1).gather(1, label_rows.clamp(min=0))
        row_loss = -(p * picked).sum(1) / p.sum(1).clamp(min=1e-6)
        answer = t_q[use] >= first
        weight = torch.where(answer, 1.0, prompt_weight)
        step_loss = (weight * row_loss).sum() / weight.sum()
        total = total + step_loss * (0.8 ** (j - 1))
        if answer.any():
            losses.append(float(row_loss.detach()[answer].mean()))
            hits.append(float((logits.detach()[answer].argmax(1) == label_rows[answer, 0]).float().mean()))
        else:
            losses.append(0.0)
            hits.append(0.0)
    return total, losses, hits


def medusa_loss(head: MedusaHead, row: dict, feats: torch.Tensor, vocab_row: torch.Tensor,
                decay: float = 0.8) -> tuple[torch.Tensor, list[float], list[float]]:
    """The loss of one sequence for Medusa heads: the sum over heads of head i's cross-entropy
    against the answer's token at t + i + 2 from the features at t (tokens off the draft
    vocabulary left out), weighted decay^i; and per head its loss and the share of rows whose top
    draft token is that token."""
    seq = row["prompt"] + row["output"]
    n, answer = len(seq), len(row["prompt"])
    tokens = torch.tensor(seq, dtype=torch.long)
    lo = max(0, answer - head.config.heads - 1)  # the first row any head needs
    logits = head(feats[lo:].float())  # [n - lo, heads, Vd]
    total, losses, hits = 0.0, [], []
    for i in range(head.config.heads):
        t = torch.arange(max(lo, answer - i - 2), n - i - 2)  # rows whose label (t + i + 2) is an answer token
        labels = vocab_row[tokens[t + i + 2]] if len(t) else t
        keep = (labels >= 0).nonzero().flatten()
        if len(keep) == 0:
            losses.append(0.0)
            hits.append(0.0)
            continue
        picked = logits[t[keep] - lo, i]
        loss = torch.nn.functional.cross_entropy(picked, labels[keep])
        total = total + loss * decay ** i
        losses.append(float(loss.detach()))
        hits.append(float((picked.detach().argmax(1) == labels[keep]).float().mean()))
    return total, losses, hits


@dataclass(frozen=True)
class Recipe:
    """What one kind of head brings to the shared stages: its config, its module, its loss (of a
    sequence: the loss, and per term its loss and top-1 agreement), how many terms the loss has,
    its proposer and its loader."""

    config: Callable  # (target, TrainArgs) -> its config
    module: type
    # (head, embeddings, row, feats, top, probs, vocab_row, TrainArgs, prompt_from) -> (loss, [loss], [top-1])
    loss: Callable
    terms: Callable  # TrainArgs -> int
    proposer: Callable  # (head, target) -> proposer
    load: Callable  # (path, target) -> head


def _eagle_proposer(head, target):
    from .proposers.eagle import EagleProposer
    return EagleProposer(head, target)


def _medusa_proposer(head, target):
    from .proposers.medusa import MedusaProposer
    return MedusaProposer(head, target)


RECIPES = {
    Method.EAGLE.value: Recipe(
        config=lambda target, a: HeadConfig.for_target(target, a.draft_vocab), module=EagleHead,
        loss=lambda head, emb, row, f, top, p, vocab_row, a, prompt_from: sequence_loss(
            head, emb, row, f, top, p, vocab_row, a.unroll, a.prompt_weight, prompt_from),
        terms=lambda a: a.unroll, proposer=_eagle_proposer, load=load_head),
    Method.MEDUSA.value: Recipe(
        config=lambda target, a: MedusaConfig.for_target(target, a.draft_vocab, a.heads), module=MedusaHead,
        loss=lambda head, emb, row, f, top, p, vocab_row, a, prompt_from: medusa_loss(head, row, f, vocab_row),
        terms=lambda a: a.heads, proposer=_medusa_proposer, load=load_medusa_head),
}


OPTIMIZER_FILE = "optim.safetensors"  # the optimizer's state for a resume: safetensors too, never a pickle


def save_optimizer(opt: torch.optim.Optimizer, path: Path) -> None:
    """The optimizer's per-parameter tensors as safetensors, its param groups as the file's metadata."""
    from safetensors.torch import save_file

    sd = opt.state_dict()
    tensors = {f"{i}.{name}": (v if isinstance(v, torch.Tensor) else torch.tensor(v)).contiguous()
               for i, st in sd["state"].items() for name, v in st.items()}
    save_file(tensors, str(path), metadata={"param_groups": json.dumps(sd["param_groups"])})


def load_optimizer(path: Path, opt: torch.optim.Optimizer) -> dict:
    """The state dict `save_optimizer` wrote, for `opt.load_state_dict`.

    >>> import tempfile
    >>> w = torch.nn.Parameter(torch.ones(2)); opt = torch.optim.AdamW([w], lr=0.1)
    >>> w.grad = torch.ones(2); opt.step()
    >>> p = Path(tempfile.mkdtemp()) / OPTIMIZER_FILE; save_optimizer(opt, p)
    >>> sd = load_optimizer(p, opt); sorted(sd["state"][0]), sd["param_groups"][0]["lr"]
    (['exp_avg', 'exp_avg_sq', 'step'], 0.1)
    """
    from safetensors import safe_open

    state: dict[int, dict] = {}
    with safe_open(str(path), framework="pt") as f:
        groups = json.loads(f.metadata()["param_groups"])
        for key in f.keys():
            i, name = key.split(".", 1)
            state.setdefault(int(i), {})[name] = f.get_tensor(key)
    return {"state": state, "param_groups": groups}


MAX_VAL_ROWS = 64


def validation_split(n: int, share: float, seed: int) -> tuple[list[int], list[int]]:
    """(training rows, held-out rows) of n distilled answers: a seeded draw of `share` of them (at
    most MAX_VAL_ROWS, none when share is 0), the same on every resume.

    >>> validation_split(10, 0.2, 0)
    ([0, 1, 2, 3, 4, 5, 7, 8], [6, 9])
    """
    held = sorted(random.Random(seed).sample(range(n), min(MAX_VAL_ROWS, round(n * share)))) if share > 0 else []
    out = set(held)
    return [r for r in range(n) if r not in out], held


def training_rows(order: list[int], share: float, seed: int) -> list[int]:
    """The `share` of the training rows a run learns from: a seeded draw, nested (a smaller share's
    rows are among a larger one's), so runs at several shares measure how a head scales with data.

    >>> training_rows(list(range(10)), 0.3, 0)
    [6, 8, 9]
    >>> set(training_rows(list(range(10)), 0.3, 0)) <= set(training_rows(list(range(10)), 0.6, 0))
    True
    """
    if share >= 1:
        return order
    ranked = order[:]
    random.Random(seed + 1).shuffle(ranked)
    return sorted(ranked[:max(1, round(len(order) * share))])


def split_rows(n: int, a: TrainArgs) -> tuple[list[int], list[int]]:
    """(the rows trained on, the held-out rows) of n distilled answers, as `a` asks."""
    order, held = validation_split(n, a.val_share, a.seed)
    return training_rows(order, a.train_share, a.seed), held


def common_prefix(seqs: list[list[int]]) -> int:
    """How many leading tokens every sequence shares (a chat template's system prompt and header).

    >>> common_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]])
    2
    """
    if not seqs:
        return 0
    n = min(map(len, seqs))
    first = seqs[0]
    return next((i for i in range(n) if any(s[i] != first[i] for s in seqs)), n)


def held_out(recipe: Recipe, head, embeddings, rows: list[dict], held: list[int], data: dict, vocab_row, a: TrainArgs,
             prompt_from: int) -> tuple[list[float], list[float]]:
    """Per term, the mean loss and top-1 agreement on the held-out rows (teacher-forced, answers)."""
    losses, hits = [], []
    with torch.no_grad():
        for r in held:
            _, ls, hs = recipe.loss(head, embeddings, rows[r], data[f"f{r}"], data[f"top{r}"], data[f"p{r}"],
                                    vocab_row, a, prompt_from)
            losses.append(ls)
            hits.append(hs)
    terms = recipe.terms(a)
    return ([sum(x[j] for x in losses) / len(losses) for j in range(terms)],
            [sum(x[j] for x in hits) / len(hits) for j in range(terms)])


def train(a: TrainArgs, work: Path, model, tokenizer, rows: list[dict], feats_path: Path, config):
    from safetensors.torch import load_file, save_file
    torch.manual_seed(a.seed)
    data = load_file(str(feats_path))
    eos = list(getattr(tokenizer, "eos_token_ids", None) or model.args.eos_token_ids)
    order, held = split_rows(len(rows), a)
    prompt_from = common_prefix([r["prompt"] for r in rows])
    vocab = draft_vocabulary([rows[r] for r in order], config.draft_vocab_size, model.args.vocab_size, eos)
    config = dataclasses.replace(config, draft_vocab_size=len(vocab))
    recipe = RECIPES[a.method]
    head = recipe.module(config, model.args).float()
    ckpt, state_file = work / "train.safetensors", work / "train.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {"step": 0, "curve": []}
    if ckpt.exists():
        head.load_state_dict(load_file(str(ckpt)))
    else:
        head.init_from(model, vocab)
    vocab_row = torch.full((model.args.vocab_size,), -1, dtype=torch.long)
    vocab_row[head.draft_vocab] = torch.arange(len(head.draft_vocab))
    embeddings = float_embeddings(model)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)
    if (work / OPTIMIZER_FILE).exists():
        opt.load_state_dict(load_optimizer(work / OPTIMIZER_FILE, opt))
    total_steps = max(1, math.ceil(a.epochs * len(order)))
    batch = a.train_batch  # sequences a step
    checks = max(batch, total_steps // 10)  # held-out check every tenth of the run
    t0 = time.perf_counter()
    step = state["step"]
    prompt_rows = f", prompt rows past position {prompt_from} weighing {a.prompt_weight}" if a.prompt_weight else ""
    log(f"[train] {len(order)} sequences, {len(held)} held out{prompt_rows}")
    while step < total_steps:
        rng = random.Random(a.seed + step // len(order))
        epoch_order = order[:]
        rng.shuffle(epoch_order)
        picks = [epoch_order[(step + b) % len(order)] for b in range(batch)]
        lr = a.lr * min(1.0, (step + batch) / (0.05 * total_steps + 1)) * 0.5 * (1 + math.cos(math.pi * step / total_steps))
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad()
        losses, hits = [], []
        for r in picks:
            loss, ls, hs = recipe.loss(head, embeddings, rows[r], data[f"f{r}"], data[f"top{r}"], data[f"p{r}"],
                                       vocab_row, a, prompt_from)
            if isinstance(loss, torch.Tensor):
                (loss / batch).backward()
            losses.append(ls)
            hits.append(hs)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += batch
        terms = recipe.terms(a)
        mean = [sum(x[j] for x in losses) / len(losses) for j in range(terms)]
        acc = [sum(x[j] for x in hits) / len(hits) for j in range(terms)]
        point = {"step": step, "loss": mean, "top1": acc, "lr": lr}
        if held and (step % checks < batch or step >= total_steps):
            point["held_loss"], point["held_top1"] = held_out(recipe, head, embeddings, rows, held, data, vocab_row,
                                                              a, prompt_from)
            log(f"[train] held out ({len(held)} answers): loss {' '.join(f'{x:.3f}' for x in point['held_loss'])}, "
                f"top-1 agreement {' '.join(f'{x:.3f}' for x in point['held_top1'])}")
        state["curve"].append(point)
        state["step"] = step
        if step % (batch * 25) < batch or step >= total_steps:
            save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(ckpt))
            save_optimizer(opt, work / OPTIMIZER_FILE)
            state_file.write_text(json.dumps(state))
            recent = state["curve"][-25:]
            rl = [sum(c["loss"][j] for c in recent) / len(recent) for j in range(terms)]
            ra = [sum(c["top1"][j] for c in recent) / len(recent) for j in range(terms)]
            spent = time.perf_counter() - t0
            log(f"[train] {min(step, total_steps)}/{total_steps} sequences ({step / len(order):.2f} epochs), "
                f"loss by draft {'head' if a.method == Method.MEDUSA else 'step'} "
                f"{' '.join(f'{x:.3f}' for x in rl)}, top-1 agreement "
                f"{' '.join(f'{x:.3f}' for x in ra)}, {spent / 60:.1f} min")
    return head.eval().requires_grad_(False)


def float_embeddings(model) -> torch.nn.Embedding:
    """The target's token embeddings in fp32, frozen: what a head trains against."""
    return torch.nn.Embedding.from_pretrained(model.tok_embeddings.weight.detach().float(), freeze=True)


# -- stage 4: evaluation ---------------------------------------------------------------------

def evaluate(a: TrainArgs, model, tokenizer, head, prompts: list[str], eval_ids: list[int]) -> dict:
    """The head in the real engine, greedy, chains of eval_k: acceptance by draft position, tau,
    and greedy output equal to plain decoding's on every prompt."""
    engine = Engine(model, tokenizer, proposers={a.method: RECIPES[a.method].proposer(head, model)}, k_policy="fixed")
    plain = Engine(model, tokenizer, proposers={})
    reached = [0] * a.eval_k  # steps whose draft had a node at position i
    accepted = [0] * a.eval_k
    steps = emitted = equal = n = 0
    for i in eval_ids:
        ids = tokenizer.chat(prompts[i])
        if not 0 < len(ids) <= a.max_prompt_tokens:
            continue
        params = SamplingParams(max_tokens=a.max_new_tokens)
        s = engine.add(ids, params, a.method, a.eval_k)
        while not s.finished:
            for out in engine.step():
                if out.stats is None or out.stats.num_draft_tokens == 0:
                    continue
                steps += 1
                emitted += out.stats.num_emitted
                for p in range(out.stats.draft_depth):
                    reached[p] += 1
                    accepted[p] += p < out.stats.num_accepted
        equal += s.output == plain.generate(ids, params, "none", 0).output
        n += 1
    by_pos = [accepted[p] / reached[p] if reached[p] else None for p in range(a.eval_k)]
    return {"prompts": n, "greedy_equal_plain": equal, "steps": steps, "tau": emitted / steps if steps else None,
            "acceptance_by_position": by_pos,
            "acceptance": sum(accepted) / sum(reached) if sum(reached) else None, "k": a.eval_k}


def plot(curve: list[dict], result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (l, r) = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = [c["step"] for c in curve]
    for j in range(len(curve[0]["loss"]) if curve else 0):
        w = max(1, len(curve) // 50)
        ys = [sum(c["loss"][j] for c in curve[max(0, i - w):i + 1]) / len(curve[max(0, i - w):i + 1])
              for i in range(len(curve))]
        line, = l.plot(steps, ys, label=f"draft step {j + 1}")
        held = [c for c in curve if "held_loss" in c]
        if held:
            l.plot([c["step"] for c in held], [c["held_loss"][j] for c in held], "o--", color=line.get_color(),
                   label=f"held out, step {j + 1}")
    l.set_xlabel("training sequences")
    l.set_ylabel("loss (soft cross-entropy)")
    l.legend()
    l.set_title("training loss")
    acc = result.get("acceptance_by_position") or []
    r.bar(range(1, len(acc) + 1), [x or 0 for x in acc])
    r.set_xlabel("draft position")
    r.set_ylabel("acceptance (greedy)")
    r.set_ylim(0, 1)
    r.set_title(f"held-back prompts: tau {result.get('tau') or 0:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the command -------------------------------------------------------------------------------

def run(a: TrainArgs) -> dict:
    if a.method not in RECIPES:
        raise ValueError(f"--method {a.method}: this command trains {' and '.join(RECIPES)} heads")
    if a.method == Method.MEDUSA:
        a = dataclasses.replace(a, eval_k=min(a.eval_k, a.heads))  # a chain has one token a head
    if a.threads:
        torch.set_num_threads(a.threads)
    out = Path(a.out)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    made = work / "method"  # the stages' files are one kind of head's: a resume must not mix kinds
    if made.exists() and made.read_text() != a.method:
        raise ValueError(f"{work} holds a {made.read_text()} run: resume it with --method {made.read_text()}, "
                         f"or choose another --out")
    made.write_text(a.method)
    prompts = read_prompts(a.prompts)
    train_ids, eval_ids = split_prompts(prompts, a.train_prompts, a.eval_prompts, a.seed)
    log(f"train-draft: {a.method} head for {a.target}: {len(train_ids)} training prompts, {len(eval_ids)} held back")
    # each stage's time, summed over the runs that worked on it (a resumed run adds its own share)
    spent_file = work / "minutes.json"
    timings = {k: v * 60 for k, v in json.loads(spent_file.read_text()).items()} if spent_file.exists() else {}

    def spent(stage: str, since: float) -> None:
        timings[stage] = timings.get(stage, 0.0) + time.perf_counter() - since
        spent_file.write_text(json.dumps({k: round(v / 60, 2) for k, v in timings.items()}))

    model, tokenizer = load_target(a.target, a.dtype, a.quantization, a.device)
    recipe = RECIPES[a.method]
    config = recipe.config(model, a)
    t = time.perf_counter()
    rows_path = distill(a, work, model, tokenizer, prompts, train_ids) if "distill" in a.stages else work / "distill.jsonl"
    spent("distill_s", t)
    rows = read_distilled(rows_path)
    if a.quantization != "none":  # features and evaluation: the target in `dtype`
        model, tokenizer = load_target(a.target, a.dtype, "none", a.device)
    t = time.perf_counter()
    feats = extract_features(a, work, model, config.feature_layers, rows)
    spent("features_s", t)
    t = time.perf_counter()
    head = train(a, work, model, tokenizer, rows, feats, config)
    spent("train_s", t)
    curve = json.loads((work / "train.json").read_text())["curve"]
    t = time.perf_counter()
    result = evaluate(a, model, tokenizer, head, prompts, eval_ids) if "eval" in a.stages else {}
    spent("eval_s", t)
    trained = {
        "command": "specfleet train-draft " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else "specfleet train-draft",
        "target": a.target, "prompts": str(a.prompts), "train_prompts": len(rows),
        "answer_tokens": sum(len(r["output"]) for r in rows),
        "sampled_share": a.sampled_share, "temperature": a.temperature,
        "epochs": a.epochs, "draft_vocab": len(head.draft_vocab),
        **({"prompt_weight": a.prompt_weight} if a.prompt_weight else {}),
        **({"train_share": a.train_share,
            "trained_answer_tokens": sum(len(rows[r]["output"]) for r in split_rows(len(rows), a)[0])}
           if a.train_share < 1 else {}),
        "held_out": {k: curve[-1][k] for k in ("held_loss", "held_top1") if curve and k in curve[-1]},
        **({"heads": a.heads} if a.method == Method.MEDUSA else {"unroll": a.unroll}),
        "minutes": {k: round(v / 60, 2) for k, v in timings.items()},
        "total_minutes": round(sum(timings.values()) / 60, 2), "eval": result,
    }
    head.config = dataclasses.replace(head.config, trained=trained)
    save_head(head, out)
    (out / "train-draft.json").write_text(json.dumps({**trained, "curve_points": len(curve)}, indent=1) + "\n")
    if curve and result:
        plot(curve, result, out / "train-draft.png")
    recipe.load(out, model)  # what serving will load: it must fit
    log(f"train-draft: wrote {out} ({trained['total_minutes']} min): acceptance {result.get('acceptance')}, "
        f"tau {result.get('tau')}, greedy == plain on {result.get('greedy_equal_plain')}/{result.get('prompts')}")
    return trained


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specfleet train-draft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = TrainArgs("", "", "")
    p.add_argument("--method", default=Method.EAGLE.value, choices=[Method.EAGLE.value, Method.MEDUSA.value])
    p.add_argument("--target", required=True, help="the target model: a GGUF file, a checkpoint folder, "
                   "smollm2 (the embedded default) or tiny-random")
    p.add_argument("--prompts", required=True, help="JSON lines with `prompt` (draft_train/prompts.jsonl)")
    p.add_argument("--out", required=True, help="the head's directory (its stages' files under DIR/work)")
    p.add_argument("--device", default=d.device, choices=DEVICES)
    p.add_argument("--dtype", default=d.dtype, help="fp32 or bf16 (bf16 on a GPU)")
    p.add_argument("--quantization", default=d.quantization, help="of the target while it answers: none or int8")
    p.add_argument("--resume", action="store_true", help="go on from the files under DIR/work (the default: a "
                   "stage whose output is complete is never redone; without --resume an existing DIR/work is refused)")
    for name in ("train_prompts", "eval_prompts", "max_prompt_tokens", "max_new_tokens", "batch", "draft_vocab",
                 "unroll", "heads", "train_batch", "top_k_labels", "seed", "threads", "eval_k"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("sampled_share", "temperature", "epochs", "lr", "prompt_weight", "val_share", "train_share"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    work = Path(ns.out) / "work"
    if work.exists() and any(work.iterdir()) and not ns.resume:
        print(f"specfleet train-draft: {work} holds an earlier run: pass --resume to go on from it, or choose "
              f"another --out", file=sys.stderr)
        return 2
    fields = {f.name for f in dataclasses.fields(TrainArgs)}
    a = TrainArgs(**{k: v for k, v in vars(ns).items() if k in fields})
    for name in ("train_prompts", "eval_prompts", "max_new_tokens", "batch", "draft_vocab", "unroll", "heads",
                 "train_batch", "top_k_labels", "eval_k"):
        if getattr(a, name) < 1:
            print(f"specfleet train-draft: --{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}",
                  file=sys.stderr)
            return 2
    if not 0 <= a.val_share < 1:
        print(f"specfleet train-draft: --val-share must be in [0, 1), got {a.val_share}", file=sys.stderr)
        return 2
    if not 0 < a.train_share <= 1:
        print(f"specfleet train-draft: --train-share must be in (0, 1], got {a.train_share}", file=sys.stderr)
        return 2
    if a.prompt_weight < 0 or (a.prompt_weight and a.method != Method.EAGLE):
        print(f"specfleet train-draft: --prompt-weight {a.prompt_weight}: a weight >= 0, for EAGLE heads (Medusa "
              f"heads learn the answers' own tokens)", file=sys.stderr)
        return 2
    if not Path(a.prompts).is_file():
        print(f"specfleet train-draft: --prompts {a.prompts}: no such file", file=sys.stderr)
        return 2
    try:
        run(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"specfleet train-draft: {e}", file=sys.stderr)
        return 2
    return 0
