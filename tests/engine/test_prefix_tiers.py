"""Host and disk tiers under the device pools: branching multi-turn sessions on device pools a
few requests big give the same greedy tokens as the cache off while restoring from both tiers;
a new engine on the same --kv-disk-path resumes from disk, also over a copy of the checkpoint at
another path; corrupted, torn and foreign objects
are counted misses, never restored, and the answers stay the same."""

import random
from pathlib import Path

import pytest
from safetensors.torch import load_file

from deltaserve import SamplingParams
from deltaserve.cache.tiers.objects import Meta, TierObject, encode

from .sched.test_cache_pressure import assert_all_free
from .test_prefix_cache import make

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
SMALL = dict(num_pages=30, num_ckpt_slots=3, max_num_seqs=2, max_num_batched_tokens=24)


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_linear"])
def ckpt(request, tmp_path_factory):
    from deltaserve.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp(request.param), family=request.param, preset="tiny", seed=21)


def sessions(vocab: int, seed: int, n: int = 5, turns: int = 4):
    """Per round, the next user message of each live session: (session, new tokens), where a
    session may first branch off another one's history (a new session sharing its past)."""
    rng = random.Random(seed)
    plan, live = [], list(range(n))
    for t in range(turns):
        rnd = []
        for s in list(live):
            fork = rng.random() < 0.3 and t > 0
            rnd.append((s, len(live) if fork else None, [rng.randrange(vocab) for _ in range(rng.randrange(3, 12))]))
            if fork:
                live.append(len(live))
        plan.append(rnd)
    return plan


def play(llms, plan, histories=None, max_len=110):
    """Run the rounds two requests at a time on every engine in `llms`; assert equal tokens;
    returns the histories (prompt + answer of each session's latest turn)."""
    hist = dict(histories or {})
    for rnd in plan:
        prompts = []
        for s, fork, new in rnd:
            base = hist.get(s, [])
            if fork is not None:
                base = hist[fork] = base[: len(base) // 2 + 1]
                s = fork
            p = (base + new)[-(max_len - GREEDY.max_tokens) :]
            prompts.append((s, p))
        for i in range(0, len(prompts), 2):
            batch = prompts[i : i + 2]
            outs = [
                [o.outputs[0].token_ids for o in llm.generate([p for _, p in batch], GREEDY, use_tqdm=False)]
                for llm in llms
            ]
            assert all(o == outs[0] for o in outs[1:])
            for (s, p), a in zip(batch, outs[0]):
                hist[s] = p + a
            llms[0].check_integrity()
    return hist


def tiers(llm) -> dict:
    return llm.stats()["prefix_cache"]["tiers"]


def test_tiers_on_equal_cache_off_and_restore_from_both(ckpt, tmp_path):
    on = make(ckpt, True, **SMALL, kv_offload_memory=400_000, kv_disk_path=str(tmp_path), kv_disk_size="64MiB")
    off = make(ckpt, False, **SMALL)
    play([on, off], sessions(on.model.config.vocab_size, 1))
    t, pc = tiers(on), on.stats()["prefix_cache"]
    assert t["host"]["hits"] > 0 and t["disk"]["hits"] > 0, t
    assert pc["checkpoints_evicted"] > 0 and pc["restore_refused"] == 0, pc
    assert t["disk"]["bytes_read"] > 0 and t["host"]["evicted"] > 0, t
    assert not any(k.startswith("verify_miss") for k in t["disk"]), t
    assert t["restore_waits"] > 0, "disk objects were read ahead while the engine stepped"
    assert_all_free(on)


def test_a_running_request_steps_while_a_restore_reads(ckpt, tmp_path):
    """B's prefix is on disk only: the step that looks B up starts the read and holds B, and A
    (running) gets its token in that step; B is then admitted with the restored prefix."""
    on = make(ckpt, True, **SMALL, kv_disk_path=str(tmp_path), kv_disk_size="64MiB")
    off = make(ckpt, False, **SMALL)
    rng = random.Random(6)
    vocab = on.model.config.vocab_size
    p = [rng.randrange(vocab) for _ in range(44)]
    b = p + [rng.randrange(vocab) for _ in range(9)]
    a = [rng.randrange(vocab) for _ in range(10)]
    on.generate([p], GREEDY, use_tqdm=False)
    on.cache.tier.flush()
    assert on.reset_prefix_cache() and tiers(on)["disk"]["objects"] > 0
    core = on.engine
    core.add_request("A", a, LONG)
    core.step()
    core.add_request("B", b, GREEDY)
    seq_a = core.requests["A"].seqs[0]
    before = len(seq_a.output_ids)
    core.step()
    assert len(seq_a.output_ids) == before + 1 and core.requests["B"].seqs[0].num_computed == 0
    assert tiers(on)["restore_waits"] == 1
    done = {}
    while core.has_unfinished():
        done.update({o.request_id: o.outputs[0].token_ids for o in core.step()})
    want = [o.outputs[0].token_ids for o in off.generate([a, b], [LONG, GREEDY], use_tqdm=False)]
    assert [done["A"], done["B"]] == want
    disk = tiers(on)["disk"]
    assert disk["hits"] == 1 and disk["hit_tokens"] == 40, disk
    assert_all_free(on)


def test_host_tier_alone_beats_the_device_alone(ckpt):
    """The same sessions: with a host tier fewer tokens are computed than with the device alone."""
    plain = make(ckpt, True, **SMALL)
    host = make(ckpt, True, **SMALL, kv_offload_memory="16MiB")
    play([host, plain], sessions(plain.model.config.vocab_size, 2))
    assert tiers(host)["host"]["hits"] > 0
    assert host.stats()["computed_tokens"] < plain.stats()["computed_tokens"]
    assert_all_free(host)


def _restarted(ckpt, path, warm_plan, next_plan, damage=None, copy=None):
    """Warm a disk tier with `warm_plan`, close the engine, optionally damage its files, start a
    new engine (on `copy` of the checkpoint, if given) on the same path and play `next_plan`
    against the cache off; the new engine."""
    first = make(ckpt, True, **SMALL, kv_disk_path=str(path), kv_disk_size="64MiB")
    off = make(ckpt, False, **SMALL)
    hist = play([first, off], warm_plan)
    first.shutdown()
    files = sorted(Path(path).glob("*/*.safetensors"))
    assert files, "the first engine wrote objects"
    if damage is not None:
        for f in files:
            damage(f)
    second = make(copy or ckpt, True, **SMALL, kv_disk_path=str(path), kv_disk_size="64MiB")
    play([second, off], next_plan, hist)
    assert_all_free(second)
    return second


def _plans(ckpt):
    from deltaserve.model.config import ModelConfig

    plan = sessions(ModelConfig.from_pretrained(ckpt).vocab_size, 3, n=3, turns=3)
    return plan[:2], [[(s, None, new) for s, _, new in plan[2]]]


def test_a_new_engine_on_the_same_disk_path_resumes(ckpt, tmp_path):
    warm, nxt = _plans(ckpt)
    second = _restarted(ckpt, tmp_path, warm, nxt)
    disk = tiers(second)["disk"]
    assert disk["objects_found"] > 0 and disk["hits"] > 0 and disk["hit_tokens"] > 0, disk


def test_a_copy_of_the_checkpoint_elsewhere_resumes_from_disk(ckpt, tmp_path):
    """The tiers' fingerprint names the model by content (`model.identity`), not its path: an
    engine on a copy of the checkpoint at another path (another host's mount) restores the
    objects an engine on the original wrote."""
    import shutil

    warm, nxt = _plans(ckpt)
    copy = shutil.copytree(ckpt, tmp_path / "elsewhere" / "model")
    second = _restarted(ckpt, tmp_path / "disk", warm, nxt, copy=copy)
    disk = tiers(second)["disk"]
    assert disk["objects_found"] > 0 and disk["hits"] > 0, disk


def _flip_byte(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x40
    f.write_bytes(bytes(data))


def _foreign(f: Path) -> None:
    """Rewrite the object, intact and digested, under another model's fingerprint."""
    from deltaserve.cache.tiers.objects import read_header

    meta, _, _ = read_header(f.read_bytes(), f.stat().st_size)
    t = load_file(f)
    obj = TierObject(Meta(meta.key, meta.parent, meta.start, meta.end, 0), t["mla"], t["tails"], t["states"])
    f.write_bytes(encode(obj, bytes(32)))


def _torn(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


@pytest.mark.parametrize(("damage", "reason"), [(_flip_byte, "digest"), (_foreign, "fingerprint"), (_torn, "torn")])
def test_damaged_objects_are_counted_misses(ckpt, tmp_path, damage, reason):
    warm, nxt = _plans(ckpt)
    second = _restarted(ckpt, tmp_path, warm, nxt, damage)
    disk = tiers(second)["disk"]
    assert disk[f"verify_miss_{reason}"] > 0 and disk["hits"] == 0, disk
