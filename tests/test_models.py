"""Model families (#13): stages built alone, split training equal to unsplit, balanced splits, bad configs."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_pipeline import config, make_stages, run_steps, train_unsplit  # noqa: F401 - make_stages is a fixture

from potluck.models import build_stage, entry_costs, forward_layers, partition, stage_bounds
from potluck.peer.training.data import Dataset, in_run_order
from potluck.protos.config.files import apply_overrides
from potluck.protos.config.runconfig import ModelConfig, PipelineConfig, RunConfig
from potluck.protos.config.section import ConfigError

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    """Tiny Hugging Face models written by transformers itself: a Llama and a Qwen2 as config only,
    a GPT-2 with weights (tied, as GPT-2 is), and a model type potluck does not support."""
    root = tmp_path_factory.mktemp("hf")
    small = {"vocab_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "max_position_embeddings": 64}
    out = {}
    for name, cfg in {
        "llama": transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_key_value_heads=2, **small),
        "qwen2": transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_key_value_heads=2, **small),
    }.items():
        cfg.save_pretrained(root / name)
        out[name] = root / name
    torch.manual_seed(1)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=3, n_head=4, n_positions=64, embd_pdrop=0.0, attn_pdrop=0.0,
        resid_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    gpt2.save_pretrained(root / "gpt2")
    out["gpt2"] = root / "gpt2"
    transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64).save_pretrained(root / "bert")
    out["bert"] = root / "bert"
    return out


def family(name: str, hf_dirs: dict[str, Path]) -> dict[str, object]:
    """Run-config overrides of one model family at test size."""
    if name == "tiny":
        return {"model.d_model": 32, "model.n_heads": 2, "model.n_layers": 3}
    if name == "llama":
        return {"model.family": "llama", "model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2,
                "model.n_layers": 3, "model.d_ff": 64}
    return {"model.family": "hf", "model.hf_model": str(hf_dirs[name.removeprefix("hf-")]),
            "model.d_model": 32, "model.n_heads": 4, "model.n_layers": 3}  # what the folder says: accepted


FAMILIES = ["tiny", "llama", "hf-llama", "hf-qwen2", "hf-gpt2"]


@pytest.mark.parametrize("name", FAMILIES)
def test_a_stage_built_alone_on_meta_equals_that_slice_of_the_whole_model(name: str, hf_dirs) -> None:  # type: ignore[no-untyped-def]
    cfg = apply_overrides(RunConfig(), {**family(name, hf_dirs), "model.tie_embeddings": False})
    whole = build_stage(cfg.model, seed=5)
    n = len(whole)
    for start, stop in [(0, 1), (1, 3), (2, n), (0, n)]:
        alone = build_stage(cfg.model, seed=5, start=start, stop=stop)
        mine = dict(alone.named_parameters())
        ref = {f"{int(k.split('.', 1)[0]) - start}.{k.split('.', 1)[1]}": v
               for k, v in whole.named_parameters() if start <= int(k.split(".", 1)[0]) < stop}
        assert mine.keys() == ref.keys()
        assert all(torch.equal(mine[k], ref[k]) for k in ref), (name, start, stop)
        # and it holds no parameter of any other entry
        assert sum(p.numel() for p in alone.parameters()) == sum(v.numel() for v in ref.values())
    other = torch.cat([p.flatten() for p in build_stage(cfg.model, seed=6, start=1, stop=2).parameters()])
    same = torch.equal(other, torch.cat([p.flatten() for p in build_stage(cfg.model, seed=5, start=1, stop=2).parameters()]))
    assert same == (name == "hf-gpt2")  # the seed decides, unless the model brings its own weights


@pytest.mark.parametrize("name", ["hf-llama", "hf-qwen2", "hf-gpt2"])
def test_hf_stages_compute_what_transformers_computes(name: str, hf_dirs) -> None:  # type: ignore[no-untyped-def]
    cfg = ModelConfig(family="hf", hf_model=str(hf_dirs[name.removeprefix("hf-")]))
    ours = build_stage(cfg, seed=0)
    ref = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(cfg.hf_model))
    if name == "hf-gpt2":  # saved with weights: a run starts from them, and so does from_pretrained
        ref = transformers.AutoModelForCausalLM.from_pretrained(cfg.hf_model)
    else:
        from potluck.models.hub import to_hf_name

        ref.load_state_dict({to_hf_name(cfg, f"layers.{k}"): v for k, v in ours.state_dict().items()}, strict=False)
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert torch.allclose(forward_layers(ours.eval(), x), ref.eval()(x).logits, atol=1e-5)


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("name", ["llama", "hf-llama", "hf-gpt2"])
def test_split_training_gives_the_unsplit_models_loss(name: str, stages: int, hf_dirs, make_stages) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    cfg = config(**{**family(name, hf_dirs), "pipeline.compression": "none", "pipeline.grad_bits": None,
                    "pipeline.stages": stages, "model.seq_len": 16})
    data = Dataset(cfg.data, cfg.model)
    piped = run_steps(make_stages(cfg), cfg, 6, in_run_order(cfg.data.num_samples, 0), data)

    _, reference = train_unsplit(cfg, data, 6)
    assert piped == pytest.approx(reference, rel=1e-4, abs=1e-5)
    assert reference[-1] < reference[0]


def test_partition_is_the_best_contiguous_split() -> None:
    """Golden: against every contiguous split, enumerated with numpy."""
    rng = np.random.default_rng(0)
    for _ in range(40):
        n, s = int(rng.integers(2, 9)), 0
        s = int(rng.integers(1, n + 1))
        costs = rng.integers(1, 100, n).astype(float)
        best = min(max(costs[a:b].sum() for a, b in zip((0, *cuts), (*cuts, n), strict=True))
                   for cuts in itertools.combinations(range(1, n), s - 1))
        counts = partition(costs.tolist(), s)
        assert sum(counts) == n and len(counts) == s and min(counts) >= 1
        edges = np.cumsum([0, *counts])
        assert max(costs[a:b].sum() for a, b in zip(edges[:-1], edges[1:], strict=True)) == best
    with pytest.raises(ValueError, match="cannot cut 3 layers into 4 stages"):
        partition([1, 2, 3], 4)


def test_balanced_splits_even_out_parameters_and_flops() -> None:
    model = ModelConfig(preset="llama-20m", vocab_size=256, seq_len=128)
    params = entry_costs(model, "params")
    assert params[1] == 12 * 0 + (2 * 384 * 384 + 2 * 384 * 128 + 3 * 384 * 1024 + 2 * 384)  # one block, by hand
    assert params[0] == params[-1] - 384 == 256 * 384
    flops = entry_costs(model, "flops")
    # a block's forward + backward: ~6 FLOPs per parameter per token, plus attention
    assert 6 * params[1] * 128 < flops[1] < 8 * params[1] * 128
    by_layers = stage_bounds(model, PipelineConfig(stages=4))
    by_params = stage_bounds(model, PipelineConfig(stages=4, balance="params"))

    def worst(bounds: list[tuple[int, int]]) -> float:
        return max(sum(params[a:b]) for a, b in bounds)

    assert worst(by_params) <= worst(by_layers)
    assert [b - a for a, b in by_params] == [4, 3, 4, 3] or worst(by_params) < worst(by_layers)


def test_presets_and_bad_model_configs_are_clear(hf_dirs) -> None:  # type: ignore[no-untyped-def]
    m = ModelConfig(preset="llama-1b")
    assert (m.family, m.d_model, m.n_layers, m.kv_heads) == ("llama", 2048, 16, 8)
    assert ModelConfig(preset="llama-20m", n_layers=4).n_layers == 4  # the file's own values win
    cases = {
        "unknown model.preset 'llama-70b'": {"model.preset": "llama-70b"},
        "needs family = 'llama'": {"model.preset": "llama-20m", "model.family": "tiny"},
        "n_kv_heads \\(3\\) must divide n_heads \\(4\\)": {"model.family": "llama", "model.n_kv_heads": 3},
        "needs model.hf_model": {"model.family": "hf"},
        "is for family = 'hf'": {"model.hf_model": "x"},
        "a 'bert' model; supported model types: llama, mistral, qwen2, gpt2": {
            "model.family": "hf", "model.hf_model": str(hf_dirs["bert"])},
        "cannot read the config of": {"model.family": "hf", "model.hf_model": str(hf_dirs["bert"].parent / "none")},
        "model.d_model = 48, but .* has 32; leave model.d_model out": {
            "model.family": "hf", "model.hf_model": str(hf_dirs["llama"]), "model.d_model": 48},
        "has 64 tokens; data.source = 'bytes' needs 256": {
            "model.family": "hf", "model.hf_model": str(hf_dirs["llama"]), "data.source": "bytes", "data.path": "x"},
    }
    for message, overrides in cases.items():
        with pytest.raises(ConfigError, match=message):
            apply_overrides(RunConfig(), overrides)
    # GPT-2 ties its embeddings; split into stages, each stage trains its own copy
    split = apply_overrides(RunConfig(), {"model.family": "hf", "model.hf_model": str(hf_dirs["gpt2"]),
                                          "pipeline.stages": 2})
    assert not split.model.tie_embeddings
    assert apply_overrides(RunConfig(), {"model.family": "hf", "model.hf_model": str(hf_dirs["gpt2"])}).model.tie_embeddings


def test_pretrained_weights_that_do_not_fit_are_refused(hf_dirs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "gpt2"
    shutil.copytree(hf_dirs["gpt2"], bad)
    weights = load_file(str(bad / "model.safetensors"))
    weights["transformer.h.1.mlp.c_fc.weight"] = weights["transformer.h.1.mlp.c_fc.weight"][:, :8].contiguous()
    save_file(weights, str(bad / "model.safetensors"))
    cfg = ModelConfig(family="hf", hf_model=str(bad), tie_embeddings=False)
    with pytest.raises(ValueError, match=r"transformer.h.1.mlp.c_fc.weight has shape \[32, 8\], the model needs \[32, 128\]"):
        build_stage(cfg, 0, 2, 3)
    build_stage(cfg, 0, 1, 2)  # a stage without the broken layer never reads it
    del weights["transformer.h.0.attn.c_attn.weight"]
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="have no 'transformer.h.0.attn.c_attn.weight'"):
        build_stage(cfg, 0, 1, 2)
    json.loads((bad / "config.json").read_text())


@pytest.mark.slow
def test_an_exported_folder_generates_and_loads_back_bit_exact(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    from potluck.generate import sample
    from potluck.models.hub import read_folder, write_folder
    from potluck.peer.training.model import Model, load_named

    cfg = ModelConfig(family="llama", d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, seq_len=16)
    net = Model(cfg, seed=3).eval()
    write_folder(tmp_path / "m", cfg, [(f"layers.{n}", p.detach()) for n, p in net.layers.named_parameters()],
                 {"version": 1, "data": {"source": "markov"}})
    back_cfg, info, tensors = read_folder(tmp_path / "m")
    back = Model(back_cfg)
    load_named(back, dict(tensors))
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert torch.equal(back(x), net(x))
    greedy = sample(net, [1, 2, 3], 12, temperature=0)
    assert sample(net, [1, 2, 3], 12, temperature=1.0, top_k=1, seed=9) == greedy  # top-1 is greedy
    assert sample(net, [1, 2, 3], 12, temperature=1.0, top_p=1e-6, seed=9) == greedy  # so is a tiny nucleus
    assert sample(net, [1, 2, 3], 30, seed=1) == sample(net, [1, 2, 3], 30, seed=1)
    assert len(sample(net, [1, 2, 3], 30)) == 30  # past seq_len: the context window slides

    def generate(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "potluck", "generate", "--model", str(tmp_path / "m"), *argv],
                              capture_output=True, text=True, timeout=120)

    done = generate("--prompt", "1 2 3", "--temperature", "0", "--max-new-tokens", "12")
    assert done.returncode == 0 and done.stdout == "1 2 3 " + " ".join(map(str, greedy)) + "\n", done.stderr
    for argv, message in [(["--prompt", "hello"], "give --prompt as numbers separated by spaces"),
                          (["--prompt", "1 99"], "outside the model's vocabulary [0, 64)"),
                          (["--prompt", "1", "--top-p", "0"], "0 < --top-p <= 1")]:
        done = generate(*argv)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
    with pytest.raises(ValueError, match="has no Hugging Face format"):
        write_folder(tmp_path / "t", ModelConfig(), [], {})


@pytest.mark.parametrize("name", ["hf-llama", "hf-qwen2", "hf-gpt2"])
def test_an_hf_run_exports_a_folder_transformers_loads_as_is(name: str, hf_dirs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from potluck.models.hub import write_folder

    cfg = ModelConfig(family="hf", hf_model=str(hf_dirs[name.removeprefix("hf-")]), tie_embeddings=False)
    layers = build_stage(cfg, seed=4)  # as a split run trains it: untied
    with torch.no_grad():  # "trained": the head no longer equals the embedding
        for p in layers[-1].parameters():
            p.add_(0.01)
    write_folder(tmp_path / "out", cfg, [(f"layers.{n}", p.detach()) for n, p in layers.named_parameters()], {})
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(loaded).__name__ == {"hf-llama": "LlamaForCausalLM", "hf-qwen2": "Qwen2ForCausalLM",
                                     "hf-gpt2": "GPT2LMHeadModel"}[name]
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, forward_layers(layers.eval(), x))
