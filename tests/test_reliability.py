"""The job that a hostile user cannot turn against itself (issue 51): --keep-last deletes only checkpoints that pass
their checks; verifying fits in what training fits in; a damaged metrics line never stops a resume; no output goes
through a link or onto a device; hostile Hugging Face folders are refused as the safetensors format refuses them;
prompts and data are read as the model reads them; --async-save keeps every guarantee of the synchronous save."""
import json
import os
import shutil
import struct

import numpy as np
import pytest
import torch

import train_gpt
from multirank import run_ranks
from test_train_gpt import _main_on_forked_ranks

TINY = train_gpt.GPTConfig(vocab_size=32, seq_len=16, n_layer=2, n_head=2, n_embd=16)
TINY_JOB = ["--data", "synthetic", "--layers", "2", "--heads", "2", "--hidden", "16", "--seq", "16", "--vocab", "32",
            "--batch", "4", "--micro-batch", "2"]


def _run(**kwargs):
    return train_gpt.JobConfig(**{**dict(batch=4, micro_batch=2, steps=2, data="synthetic", log=False), **kwargs})


def _losses(rank, world, cfg=TINY, **kwargs):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in train_gpt.train_job(cfg, _run(**kwargs))]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A folder of four one-rank checkpoints (steps 1 to 4) of TINY, copied by the tests that change it."""
    out = str(tmp_path_factory.mktemp("saved") / "out")
    run_ranks(_losses, 1, steps=4, save_every=1, out_dir=out, timeout=120)
    return out


def _flip(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))


def _steps(out):
    return sorted(n for n in os.listdir(out) if n.startswith("step_"))


# ---- --keep-last: only what passes its checks counts, and only that is deleted ------------------------------

def test_keep_last_counts_and_deletes_only_passing_checkpoints_never_a_link_a_fallback_or_one_being_read(
        saved, tmp_path, monkeypatch):
    said = []
    monkeypatch.setattr(train_gpt, "_warn", said.append)
    monkeypatch.setattr(train_gpt, "_SAID", set())
    out = tmp_path / "out"
    shutil.copytree(saved, out)
    shutil.move(out / "step_000004", tmp_path / "step_000004")  # back later
    _flip(out / "step_000003" / "__0_0.distcp")  # the newest damaged
    (out / "step_000100").mkdir()  # junk that looks like the newest
    (out / "step_000100" / "train_state.json").write_text("{}")
    (tmp_path / "elsewhere").mkdir()
    shutil.copytree(out / "step_000001", tmp_path / "elsewhere" / "step_000000")
    os.symlink(tmp_path / "elsewhere" / "step_000000", out / "step_000000")  # a link, oldest
    train_gpt.drop_old_checkpoints(str(out), 1)
    # step 2 is the newest that passes: it stays; step 1 (passing, older) goes; 3 and 100 fail: neither counted nor
    # deleted; the link stays and so does its target
    assert _steps(out) == ["step_000000", "step_000002", "step_000003", "step_000100"], said
    assert os.path.isdir(tmp_path / "elsewhere" / "step_000000")
    assert any("fail their checks and are neither counted nor deleted" in s for s in said), said
    assert any("symbolic link" in s for s in said), said
    shutil.move(tmp_path / "step_000004", out / "step_000004")  # a newer one that passes
    train_gpt._FALLBACK_SOURCES.add(os.path.realpath(out / "step_000002"))  # as a resume that fell back to it
    try:
        train_gpt.drop_old_checkpoints(str(out), 1)
        assert "step_000002" in _steps(out) and any("this run resumed from it" in s for s in said), said
    finally:
        train_gpt._FALLBACK_SOURCES.clear()
    train_gpt.lock_for_reading(str(out / "step_000002"))  # a --sample reads it: kept while it does
    train_gpt.drop_old_checkpoints(str(out), 1)
    assert "step_000002" in _steps(out) and any("is reading it" in s for s in said), said
    train_gpt.done_reading()
    train_gpt.drop_old_checkpoints(str(out), 1)
    assert _steps(out) == ["step_000000", "step_000003", "step_000004", "step_000100"]
    with pytest.raises(train_gpt.BadCheckpoint, match="cannot be opened"):  # a reader finds it gone in one line
        train_gpt.lock_for_reading(str(out / "step_000002"))


def test_resume_with_keep_last_after_a_fallback_keeps_the_checkpoint_it_resumed_from(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "out")
    shutil.rmtree(tmp_path / "out" / "step_000004")
    _flip(tmp_path / "out" / "step_000003" / "__0_0.distcp")
    (code, out, _), = _main_on_forked_ranks(TINY_JOB + ["--out-dir", "out", "--resume", "--steps", "5",
                                                        "--save-every", "1", "--keep-last", "1", "--lr", "3e-3",
                                                        "--optimizer", "adamw"], 1, str(tmp_path))
    assert code == 0 and "skipping checkpoint out/step_000003" in out, out
    # the fallback's source (2) stays; the run's own 3 (written over the damaged one) and 4 go, 5 is the newest
    assert _steps(tmp_path / "out") == ["step_000002", "step_000005"], out


# ---- verifying fits in what training fits in --------------------------------------------------------------

def _check_under_an_address_space_limit(path, extra_bytes):
    import resource
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (used + extra_bytes, resource.RLIM_INFINITY))
    train_gpt.check_checkpoint(path)  # .metadata and train_state.json read, the metadata unpickled


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="Linux's /proc")
def test_checking_a_checkpoint_reserves_no_more_memory_than_its_files_and_running_out_is_not_damage(
        saved, monkeypatch):
    pid = os.fork()
    if pid == 0:  # a forked child under 512 MiB more address space: a 2 GiB read bound reserved up front fails
        code = 1
        try:
            torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP thread pool
            _check_under_an_address_space_limit(saved + "/step_000001", 512 << 20)
            code = 0
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0

    def no_memory(self):
        raise MemoryError()
    monkeypatch.setattr(train_gpt._SafeUnpickler, "load", no_memory)
    with pytest.raises(train_gpt.CannotVerify, match="ran out of memory reading .metadata .*not known to be damaged"):
        train_gpt.latest_checkpoint(saved)  # no fallback to an older one: nothing is wrong with this one


# ---- metrics: a damaged line is said once and set aside, read with bounded memory ---------------------------

def test_damaged_metrics_lines_are_set_aside_once_and_read_in_bounded_memory(tmp_path, monkeypatch):
    import tracemalloc
    said = []
    monkeypatch.setattr(train_gpt, "_warn", said.append)
    path = tmp_path / "m.jsonl"
    good = [json.dumps({"step": i, "loss": 1.0}) + "\n" for i in range(4)]
    with open(path, "wb") as f:
        f.write(good[0].encode() + b'{"step": 1, "loss": \xff}\n' + good[1].encode() + b"[" * 100_000 + b"\n")
        f.write(b"x" * (8 << 20) + b"\n" + good[2].encode() + good[3].encode() + b'{"st')  # 8 MB line, torn end
    tracemalloc.start()
    kept, damaged = train_gpt._metrics_before(str(path), 3)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert kept == good[:3] and sum(damaged.values()) == 3 and peak < 4 << 20, (damaged, peak)
    before = path.read_bytes()
    train_gpt.open_metrics(str(path), 3).close()
    assert path.read_text() == "".join(good[:3]) and (tmp_path / "m.jsonl.1").read_bytes() == before
    assert len(said) == 1 and "3 of its lines cannot be read" in said[0] and "m.jsonl.1" in said[0], said


# ---- outputs: never through a link, never onto a device or a FIFO, never over the run's inputs -------------

def test_no_output_goes_through_a_link_or_onto_a_device_or_a_fifo(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, tmp_path / "out.pt.tmp")  # planted where the temporary goes
    train_gpt._write_file(str(tmp_path / "out.pt"), lambda f: f.write(b"exported"), "--export-nanogpt")
    assert victim.read_text() == "precious" and (tmp_path / "out.pt").read_bytes() == b"exported"
    assert not os.path.lexists(tmp_path / "out.pt.tmp")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    os.mkfifo(tmp_path / "fifo")
    for path, says in ((str(victim), None), (str(tmp_path / "dangling"), "symbolic link"),
                       (str(tmp_path / "fifo"), "a FIFO"), ("/dev/null", "a character device")):
        if says is None:
            train_gpt.check_output_name("--metrics", path)  # a regular file: replaced whole, fine
            continue
        with pytest.raises(train_gpt.OutputRefused, match=says):
            train_gpt.check_output_name("--export-nanogpt", path)
        with pytest.raises(ValueError, match=says):
            train_gpt._check_metrics_file(path)
    assert not os.path.exists(tmp_path / "nowhere")
    fd = train_gpt.create_exclusive(str(tmp_path / "dangling"))  # a link in the way is removed, never followed
    os.close(fd)
    assert not os.path.exists(tmp_path / "nowhere")
    with pytest.raises(train_gpt.OutputRefused, match="nothing can be written in /proc"):
        train_gpt._try_writing("--export-nanogpt", "/proc/x.pt", "/proc")


def test_metrics_never_name_a_held_lock_or_the_hf_folder_and_exports_never_the_training_data(saved, tmp_path):
    import fcntl
    lock = tmp_path / "other" / ".lock"
    lock.parent.mkdir()
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another live run's
    try:
        with pytest.raises(ValueError, match="is the lock file of a run"):
            train_gpt._check_metrics_file(str(lock))
    finally:
        os.close(fd)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="lies inside the --init-from-hf folder"):
        train_gpt.check_outputs_apart_from_inputs(_run(metrics=str(hf / "config.json"), init_from_hf=str(hf)))
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("text " * 100)
    state = train_gpt.read_train_state(saved + "/step_000001")
    for kwargs in (dict(hf_dir=str(data)), dict(nanogpt_file=str(data / "a.txt"))):
        with pytest.raises(ValueError, match="would write into the --data"):
            with pytest.MonkeyPatch.context() as m:
                m.setattr(train_gpt, "sample_checkpoint",
                          lambda out_dir, world, flag: (saved + "/step_000001", {**state, "data": str(data)}))
                train_gpt.export_source(saved, None, 1, **kwargs)
    assert os.listdir(data) == ["a.txt"]


# ---- hostile Hugging Face folders ----------------------------------------------------------------------------

def _hf_folder(path, cfg=TINY, edit=None, tail=b"", values=None):
    """A GPT-2 folder of cfg's shape (config.json, model.safetensors), the header edited by edit(header, text)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(train_gpt.hf_config(cfg)))
    gen = torch.Generator().manual_seed(0)
    tensors = {"transformer." + n: torch.randn(s, generator=gen) * 0.02 for n, s in train_gpt.gpt2_shapes(cfg).items()}
    for name, value in (values or {}).items():
        tensors[name].view(-1)[0] = value
    chunks = list(train_gpt.safetensors_chunks(tensors, {"format": "pt"}))
    text = chunks[0][8:]
    if edit:
        text = edit(json.loads(text), text)
        text += b" " * (-len(text) % 8)
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text +
                                             b"".join(bytes(c) for c in chunks[1:]) + tail)
    return str(path)


def test_hostile_safetensors_files_are_refused_as_the_format_refuses_them_and_shapes_are_compared_first(tmp_path):
    import time
    w, b = "transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias"

    def twice(header, text):
        return text.rstrip()[:-1] + f', "{w}": {json.dumps(header[b])}}}'.encode()

    def overlap(header, text):
        header[b]["data_offsets"] = header[w]["data_offsets"]
        return json.dumps(header).encode()

    def hole(header, text):
        for entry in header.values():
            if isinstance(entry, dict) and "data_offsets" in entry and entry["data_offsets"][0] > 0:
                entry["data_offsets"] = [o + 64 for o in entry["data_offsets"]]
        return json.dumps(header).encode()
    cases = [("twice", dict(edit=twice), f"names {w!r} twice"),
             ("overlap", dict(edit=overlap), "tensors overlap"),
             ("tail", dict(tail=bytes(64)), "last 64 bytes are indexed by no tensor"),
             ("hole", dict(edit=hole), "bytes that no tensor indexes")]
    for name, kwargs, says in cases:
        folder = _hf_folder(tmp_path / name, **kwargs)
        if name == "hole":  # the 64 bytes the offsets skip
            data = open(folder + "/model.safetensors", "rb").read()
            length = struct.unpack("<Q", data[:8])[0]
            first = json.loads(data[8:8 + length])["transformer.wte.weight"]["data_offsets"][1]
            open(folder + "/model.safetensors", "wb").write(data[:8 + length + first] + bytes(64) +
                                                            data[8 + length + first:])
        with pytest.raises(train_gpt.BadCheckpoint, match=says):
            train_gpt.config_from_hf(folder, TINY, {})
    folder = _hf_folder(tmp_path / "deep")
    config = json.loads(open(folder + "/config.json").read())
    open(folder + "/config.json", "w").write(json.dumps({**config, "n_layer": 65536}))
    t0 = time.monotonic()
    with pytest.raises(train_gpt.BadCheckpoint, match="says n_layer 65536, and .* holds the weights of 2 blocks"):
        train_gpt.config_from_hf(folder, TINY, {})
    assert time.monotonic() - t0 < 5  # compared before a model of 65536 blocks is built


def _init_from(rank, world, folder, **kwargs):
    try:
        train_gpt.train_job(TINY, _run(init_from_hf=folder, steps=1, **kwargs))
    except train_gpt.BadCheckpoint as e:
        return str(e)


def test_non_finite_or_huge_imported_weights_are_named_before_training_on_every_rank(tmp_path):
    cases = [("nan", "transformer.h.1.mlp.c_fc.weight", float("nan"), "non-finite"),
             ("inf", "transformer.wte.weight", float("inf"), "non-finite"),
             ("big", "transformer.h.1.attn.c_attn.weight", 3e38, "beyond")]
    for name, tensor, value, says in cases[:2]:
        folder = _hf_folder(tmp_path / name, values={tensor: value})
        said = run_ranks(_init_from, 1, folder, timeout=120)[0]
        assert said and repr(tensor) in said and says in said, said
    folder = _hf_folder(tmp_path / "big", values={cases[2][1]: cases[2][2]})
    said = run_ranks(_init_from, 2, folder, pp=2, timeout=120)  # block 1 is stage 1's: rank 0 stops too, saying it
    assert all(s and repr(cases[2][1]) in s and "beyond" in s for s in said), said


# ---- the command line: empty paths, prompts read as the model reads them, bounded samples, data as nanoGPT reads it

def test_empty_paths_a_bounded_sample_and_nothing_written_without_being_asked(tmp_path):
    for flag in ("--init-from-hf", "--export-hf", "--out-dir", "--metrics", "--data", "--prompt-file",
                 "--export-nanogpt"):
        with pytest.raises(ValueError, match=f"{flag} '' is an empty path"):
            train_gpt.parse_job_args([flag, ""])
    with pytest.raises(ValueError, match="must be between 1 and 1,000,000"):
        train_gpt.parse_job_args(["--sample", str(10 ** 20), "--out-dir", "x"])
    with pytest.raises(ValueError, match="pass one of them per run"):
        train_gpt.parse_job_args(["--sample", "5", "--export-hf", "hf", "--out-dir", "x"])
    os.mkfifo(tmp_path / "fifo")  # read, it would block: refused before any byte of it is read
    with pytest.raises(ValueError, match="go with --sample N"):
        train_gpt.parse_job_args(["--prompt-file", str(tmp_path / "fifo")])
    assert train_gpt.parse_job_args([])[1].metrics is None  # no --out-dir, no --metrics: no metrics file
    assert train_gpt.parse_job_args(["--out-dir", "o"])[1].metrics == os.path.join("o", "metrics.jsonl")


def test_prompts_are_read_as_the_model_reads_them(tmp_path):
    import tracemalloc
    flags = train_gpt.parse_job_args(["--sample", "1", "--out-dir", "x"])[2]
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # 1 GiB of zeros (sparse): only its last --seq bytes are read
        f.seek(-4, 2)
        f.write(b"caf\xe9")
    flags.prompt_file = str(big)
    tracemalloc.start()
    data = train_gpt.prompt_bytes(flags, TINY, text=True)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert data == bytes(12) + b"caf\xe9" and peak < 1 << 20  # a byte model takes bytes as they are
    assert train_gpt.prompt_ids(data, True, 256)[-1] == 0xE9
    (tmp_path / "ids").write_bytes(b"1 2  3\n" * 1000 + b"4 5 " + b" " * 100_000)
    flags.prompt_file = str(tmp_path / "ids")
    assert train_gpt.prompt_bytes(flags, TINY, text=False).split() == (b"1 2 3 " * 1000).split()[-14:] + [b"4", b"5"]
    for prompt, says in (("²", "'²' is not a token id"), ("7" * 5000, "'77777777777777777777...' is not a token id"),
                         ("32", "'32' is not a token id: .* pass ids between 0 and 31")):
        with pytest.raises(ValueError, match=says):
            train_gpt.prompt_ids(prompt, False, 32)


def test_a_text_file_is_memory_mapped_and_batched_as_before(tmp_path):
    text = ("the quick brown fox jumps over the lazy dog. " * 50).encode()
    (tmp_path / "a.txt").write_bytes(text)
    data = train_gpt.load_data(str(tmp_path / "a.txt"), 16, 256)
    assert isinstance(data.train, np.memmap) and data.train.dtype == np.uint8  # 1 byte a token, paged in
    whole = torch.tensor(list(text))
    n_val = int(len(text) * train_gpt.VAL_FRACTION)
    held = train_gpt.TokenData("t", whole[:-n_val], whole[-n_val:], text=True)  # the int64 tensors of before
    for split in ("train", "val"):
        assert torch.equal(data.batch(split, 3, 4, 16, 0), held.batch(split, 3, 4, 16, 0))


# ---- what the noisy cases say now ------------------------------------------------------------------------------

def test_the_noisy_cases_say_one_true_line(saved, tmp_path, monkeypatch):
    cfg = train_gpt.GPTConfig(vocab_size=258, n_head=4)
    with pytest.raises(ValueError, match=r"--tp 4 must divide the vocabulary of --init-from-hf hf, 258 .*\[1, 2\]"):
        train_gpt.validate(cfg, train_gpt.JobConfig(tp=4, init_from_hf="hf", batch=8), 4)
    for recompute in ("offload", "selective", "selective+offload"):  # they run no GEMM twice
        train_gpt.validate(TINY, train_gpt.JobConfig(dtype="fp8", fp8_recipe="delayed", recompute=recompute), 1)
    with pytest.raises(ValueError, match="recompute full runs the blocks' GEMMs again"):
        train_gpt.validate(TINY, train_gpt.JobConfig(dtype="fp8", fp8_recipe="delayed", recompute="full"), 1)
    said = []
    out = tmp_path / "out"
    shutil.copytree(saved, out)
    for k in range(100, 110):  # ten newer folders that are not checkpoints: one line with the count
        (out / f"step_{k:06d}").mkdir()
        (out / f"step_{k:06d}" / "train_state.json").write_text("{}")
    assert train_gpt.latest_checkpoint(str(out), say=said.append)[0].endswith("step_000004")
    assert len(said) == 1 and "skipping the 10 newest folders" in said[0], said
    monkeypatch.setattr(train_gpt, "_warn", said.append)  # a restarted --init-from-hf job whose folder is gone
    flags = train_gpt.parse_job_args(["--init-from-hf", str(tmp_path / "gone"), "--resume", "--out-dir", str(out)])
    assert flags[1].init_from_hf is None and flags[0].n_layer == 2 and flags[0].vocab_size == 32
    assert "is gone; --resume continues from" in said[-1], said


# ---- --async-save: staged in host memory, written in the background, every guarantee kept ---------------------

def test_a_resume_from_asynchronous_saves_equals_the_uninterrupted_run_bit_for_bit(tmp_path):
    run = dict(steps=4, save_every=2, async_save=True, zero=1, optimizer="adamw")  # DP2: each rank its own shards
    whole = run_ranks(_losses, 2, out_dir=str(tmp_path / "a"), **run, timeout=120)[0]
    assert _steps(tmp_path / "a") == ["step_000002", "step_000004"]
    assert train_gpt.verified_checkpoint(str(tmp_path / "a" / "step_000004"))["step"] == 4
    shutil.rmtree(tmp_path / "a" / "step_000004")
    resumed = run_ranks(_losses, 2, out_dir=str(tmp_path / "a"), resume=True, **run, timeout=120)[0]
    assert resumed == whole[2:], (resumed, whole)


def test_a_rank_killed_in_the_middle_of_a_background_write_leaves_the_earlier_checkpoints_and_resume_skips_it(
        tmp_path, monkeypatch):
    job = TINY_JOB + ["--steps", "4", "--save-every", "2", "--async-save", "--out-dir", "out"]
    real = train_gpt.checksums

    def killed_while_writing_step_4(folder, names):
        if folder.endswith("step_000004.tmp"):  # DCP wrote the tensor files; MANIFEST and the rename never come
            os._exit(9)
        return real(folder, names)
    monkeypatch.setattr(train_gpt, "checksums", killed_while_writing_step_4)
    (code, out, _), = _main_on_forked_ranks(job, 1, str(tmp_path))
    assert code == 9 and "saved out/step_000004 to host memory; writing it in the background" in out, out
    assert _steps(tmp_path / "out") == ["step_000002", "step_000004.tmp"]
    monkeypatch.setattr(train_gpt, "checksums", real)
    (code, out, _), = _main_on_forked_ranks(job + ["--resume"], 1, str(tmp_path))
    removed = [line for line in out.splitlines() if "step_000004.tmp" in line]
    assert code == 0 and len(removed) == 1 and "resumed from out/step_000002" in out, out
    (code, again, _), = _main_on_forked_ranks(job[:-1] + ["again"], 1, str(tmp_path))  # uninterrupted
    losses = [[json.loads(line)["loss"] for line in open(tmp_path / folder / "metrics.jsonl")]
              for folder in ("out", "again")]
    assert code == 0 and losses[0] == losses[1] and len(losses[0]) == 4, (losses, again)
    assert _steps(tmp_path / "out") == ["step_000002", "step_000004"]


# ---- NVFP4 on the outlier batches: the forward is not where the loss jumps -----------------------------------
# At the model (seed 7), NVFP4's loss is 2.9-4.1 % above BF16's at steps 10, 14 and 18, whose batches hold
# text tables (runs of '-', '=', '|' and spaces). Those batches are where NVFP4's forward differs most from BF16's at
# the same weights, 10-30 times more than on the others, but by 0.01-0.09 % on the weights NVFP4 trained (0.3 % on
# BF16's), and downwards: the jump is in the weights its 4-bit trajectory reached (a BF16 run at 1.1 x --lr jumps at
# the same steps), not in how it computes the batch. This test holds the forward on them to that: a quantisation
# defect that shows on outlier activations (a block scale, the tensor scale) moves the loss by far more than 0.5 %.

def _nvfp4_and_bf16_forward_on_table_batches(rank, world):
    cfg = train_gpt.GPTConfig(n_layer=4, n_head=4, n_embd=64, seq_len=64, seed=7)
    run = train_gpt.JobConfig(batch=8, micro_batch=8, lr=3e-3, steps=10, dtype="bfloat16", log=False)
    data = train_gpt.load_data("embedded", cfg.seq_len, cfg.vocab_size)
    trained = {}
    real = train_gpt.train_step

    def keep_the_weights(stage, *args, **kwargs):
        out = real(stage, *args, **kwargs)
        trained.update({n: p.detach().clone() for n, p in stage.named_parameters()})
        return out
    train_gpt.train_step = keep_the_weights
    try:
        train_gpt.train_job(cfg, run, data)
    finally:
        train_gpt.train_step = real
    losses = []
    for dtype in ("nvfp4", "bfloat16"):
        plan, stage, _, pipe = train_gpt.build_job(cfg, train_gpt.JobConfig(batch=8, micro_batch=8, dtype=dtype),
                                                   optimizer=False)
        with torch.no_grad():
            for n, p in stage.named_parameters():
                p.copy_(trained[n])
            losses.append([train_gpt.run_schedule(stage, pipe, "forward", list(plan.micro_batches(
                data.batch("train", step, 8, cfg.seq_len, cfg.seed), 8, "cpu")), 0)[0].item()
                for step in (10, 14, 18)])
    return losses


def test_nvfp4s_forward_on_the_outlier_batches_equals_bf16s_at_the_same_weights():
    nvfp4, bf16 = run_ranks(_nvfp4_and_bf16_forward_on_table_batches, 1, timeout=120)[0]
    for a, b in zip(nvfp4, bf16):
        assert abs(a / b - 1) < 5e-3, (nvfp4, bf16)  # measured 3.0e-3, 6e-5, 2.4e-4
