"""Integration tests of ``recipes/qlora_finetune_distributed.py`` on 2 gloo processes (tiny model, CPU).

References are independent of the code under test where possible: the single-device recipe on the same global
batch, an uninterrupted run for resume, the unpruned model for vocab pruning, and the base checkpoint's tensors.
Runs go through ``tune run --nproc_per_node 2`` (the user's command) or, where ranks must be inspected, through
real processes spawned by ``run_distributed``; the single-device reference runs in this process.
"""

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist
from conftest import run_distributed, run_recipe_in_process
from omegaconf import OmegaConf
from safetensors.torch import load_file

from torchtune_ext.config import CONFIG_ERROR_EXIT_CODE, ConfigError

pytestmark = [pytest.mark.integration_test, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
# Relative to ROOT (the runs' cwd): `tune run --nproc_per_node` turns the recipe path into a module name.
DIST_RECIPE = "recipes/qlora_finetune_distributed.py"
SINGLE_RECIPE = "recipes/qlora_finetune_single_device.py"
CONFIG = ROOT / "configs" / "tiny" / "qlora_distributed.yaml"
TUNE = Path(sys.executable).parent / "tune"
STEPS = 4
PER_RANK_BATCH = 4
VOCAB_SIZE = 512
RUN_TIMEOUT_S = 300


def _overrides(out: Path, base: Path) -> List[str]:
    """Keeps every run tiny: 4 optimizer steps on short sequences, a larger LR so that steps change the loss."""
    return [
        f"output_dir={out}",
        f"checkpointer.checkpoint_dir={base}",  # the fixture wrote it: generate_base_checkpoint finds it there
        f"max_steps_per_epoch={STEPS}",
        "dataset.num_samples=128",
        "dataset_val.num_samples=16",
        "run_val_every_n_steps=null",
        "tokenizer.max_seq_len=48",
        "lr_scheduler.num_warmup_steps=1",
        "optimizer.lr=1e-2",
        "process_group_timeout_s=60",
        "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
        f"metric_logger.log_dir={out}/logs",
    ]


def _env() -> Dict[str, str]:
    # No PYTHONPATH: `tune run recipes/...` from the clone must work as users type it.
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _tune_run(args: List[str]) -> subprocess.CompletedProcess:
    """``tune run --nproc_per_node 2`` of the distributed recipe with the tiny config and ``args``."""
    cmd = [str(TUNE), "run", "--nproc_per_node", "2", DIST_RECIPE, "--config", str(CONFIG), *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def _check(result: subprocess.CompletedProcess) -> None:
    output = f"{result.stdout[-3000:]}\n{result.stderr[-8000:]}"
    assert result.returncode == 0, f"run failed (rc {result.returncode}):\n{output}"


def _logged(out: Path, key: str = "loss") -> List[float]:
    """Values of ``key`` per step from the DiskLogger files under ``out/logs`` (a resumed run adds a file)."""
    by_step = {}
    for path in sorted((out / "logs").glob("log_*.txt")):
        for line in path.read_text().splitlines():
            match = re.match(rf"Step (\d+) \| .*\b{key}:(\S+)", line)
            if match:
                by_step[int(match.group(1))] = float(match.group(2))
    return [by_step[s] for s in sorted(by_step)]


def _merged(out: Path, step: int = STEPS) -> Dict[str, torch.Tensor]:
    folder = out / f"step_{step}" / "merged"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(folder / name))
    return tensors


def _adapter(out: Path, step: int = STEPS) -> Dict[str, torch.Tensor]:
    return load_file(out / f"step_{step}" / "adapter" / "adapter_model.safetensors")


def _assert_same_tensors(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], atol: float) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    worst = 0.0
    for key in a:
        assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype, key
        worst = max(worst, (a[key].float() - b[key].float()).abs().max().item())
    assert worst <= atol, f"max abs difference {worst} > {atol}"
    return worst


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    from torchtune_ext.data import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_base"), family="llama", dtype="fp32", seed=0)


@pytest.fixture(scope="module")
def dist_run(base, tmp_path_factory) -> Path:
    """4 steps on 2 ranks, batch 4 per rank, fp32."""
    out = tmp_path_factory.mktemp("dist")
    _check(_tune_run(_overrides(out, base) + [f"batch_size={PER_RANK_BATCH}"]))
    return out


@pytest.mark.stack
def test_matches_single_device_on_the_same_global_batch(base, dist_run, tmp_path):
    # The same config file, the single-device recipe with the global batch (2 x 4) on one process.
    single = tmp_path / "single"
    args = ["--config", str(CONFIG), *_overrides(single, base), f"batch_size={2 * PER_RANK_BATCH}"]
    run_recipe_in_process(ROOT / SINGLE_RECIPE, args, cwd=ROOT)  # in this process: only its outputs are compared
    ours, reference = _logged(dist_run), _logged(single)
    assert len(ours) == len(reference) == STEPS
    assert max(abs(a - b) for a, b in zip(ours, reference)) < 1e-4, (ours, reference)
    assert len({round(v, 3) for v in ours}) == STEPS  # the steps train: a loss per batch, not a constant
    # Two ranks' halves all-reduced against one product over the batch: fp32 summation orders differ (on x86 CPUs
    # oneDNN's blocking also follows the row count), measured 2.4e-6 on 2026-12-07; a wrong gradient scale or a
    # missed reduction moves weights by ~lr (1e-2).
    _assert_same_tensors(_merged(dist_run), _merged(single), atol=1e-5)
    # Adam turns fp32 rounding differences of near-zero gradients (sums in another order) into steps far below lr
    # (1e-2): 2.8e-5 measured on 2026-12-07 with oneDNN's products (as in test_vocab_pruning_remapping...).
    _assert_same_tensors(_adapter(dist_run), _adapter(single), atol=1e-4)
    # The logs carry the memory of every rank.
    assert _logged(dist_run, "peak_rss/rank1") and _logged(dist_run, "tokens_per_second")


def test_resume_matches_uninterrupted_run(base, dist_run, tmp_path):
    out = tmp_path / "resumed"
    args = _overrides(out, base) + [f"batch_size={PER_RANK_BATCH}"]
    _check(_tune_run(args + [f"stop_after_step={STEPS // 2}"]))
    # Stopping mid-epoch saves the adapter (adapter-only gather) and the recipe state, no merged model.
    assert (out / f"step_{STEPS // 2}" / "adapter" / "adapter_model.safetensors").is_file()
    assert not (out / f"step_{STEPS // 2}" / "merged").exists()
    _check(_tune_run(args + ["resume_from_checkpoint=True"]))
    resumed, straight = _logged(out), _logged(dist_run)
    assert len(resumed) == STEPS
    assert max(abs(a - b) for a, b in zip(resumed, straight)) < 1e-5, (resumed, straight)
    _assert_same_tensors(_merged(out), _merged(dist_run), atol=1e-6)


# ---------------------------------------------------------------------------------------------- in-process ranks


def _recipe_cfg(out: Path, base: Path, extra: List[str]):
    overrides = _overrides(out, base) + [f"batch_size={PER_RANK_BATCH}", *extra]
    return OmegaConf.merge(OmegaConf.load(CONFIG), OmegaConf.from_dotlist(overrides))


def _train(out: Path, base: Path, extra: List[str]):
    from recipes.qlora_finetune_distributed import QLoRAFinetuneRecipeDistributed

    cfg = _recipe_cfg(out, base, extra)
    recipe = QLoRAFinetuneRecipeDistributed(cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.cleanup()
    return recipe


def _same_on_every_rank(tensor: torch.Tensor) -> bool:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.contiguous())
    return all(torch.equal(gathered[0], t) for t in gathered[1:])


def _vocab_pruning_worker(rank: int, world_size: int, base: str, tmp: str, reference_losses: List[float]) -> None:
    import recipes.qlora_finetune_distributed as recipe_module

    base, tmp = Path(base), Path(tmp)
    # Rank 0 streams the base checkpoint in many small chunks here (the reference run read it in one).
    recipe_module._LOAD_CHUNK_BYTES = 64 * 1024
    # 1. All ids kept, in a shuffled order, rows frozen: the remapped model is the unpruned one.
    permutation = list(range(VOCAB_SIZE))
    random.Random(0).shuffle(permutation)
    kept_file = tmp / "kept_all.json"
    if rank == 0:
        kept_file.write_text(json.dumps(permutation))
    dist.barrier()
    recipe = _train(
        tmp / "permuted",
        base,
        [
            "vocab_pruning.enabled=True",
            f"vocab_pruning.kept_ids={kept_file}",
            "vocab_pruning.trainable=False",
        ],
    )
    losses = recipe.loss_history
    assert max(abs(a - b) for a, b in zip(losses, reference_losses)) < 1e-4, (losses, reference_losses)

    # 2. The ids the data uses, trained in fp32: replicated and sharded.
    for sharding in ("replicated", "sharded"):
        recipe = _train(tmp / sharding, base, ["vocab_pruning.enabled=True", f"vocab_pruning.sharding={sharding}"])
        pruning = recipe._pruning
        assert pruning.num_embeddings < VOCAB_SIZE
        weight = pruning.weight
        assert weight.dtype == torch.float32
        if sharding == "replicated":
            assert not hasattr(weight, "full_tensor")
            # Every param, sharded or not, ends up identical across ranks after the steps.
            for name, param in recipe._model.named_parameters():
                full = param.full_tensor() if hasattr(param, "full_tensor") else param.detach()
                if not hasattr(param, "full_tensor"):
                    assert _same_on_every_rank(full), f"{name} differs across ranks"
            assert _same_on_every_rank(weight.detach())
        else:
            assert hasattr(weight, "full_tensor")  # its own FSDP unit
        if rank == 0:
            torch.save(pruning.kept_ids, tmp / sharding / "kept_ids.pt")


def test_vocab_pruning_remapping_replicated_and_sharded(base, dist_run, tmp_path):
    run_distributed(_vocab_pruning_worker, 2, str(base), str(tmp_path), _logged(dist_run))

    # All kept, frozen rows: the exported checkpoint is the unpruned run's, rows in the right order. The loss sums
    # the softmax over the vocabulary in the permuted order (and, sharded, through the checkpointed path instead of
    # the fused one): fp32 rounding of ~1e-7 in the gradients, which Adam's normalisation makes ~lr-sized for
    # near-zero gradients (measured 5.5e-6 after 4 steps at lr 1e-2).
    _assert_same_tensors(_merged(tmp_path / "permuted"), _merged(dist_run), atol=2e-5)

    # Replicated and sharded save the same tensors.
    replicated, sharded = tmp_path / "replicated", tmp_path / "sharded"
    _assert_same_tensors(_merged(replicated), _merged(sharded), atol=2e-5)
    # The adapters themselves, before the merge averages rows out: Adam's normalisation turns the paths' fp32
    # rounding into differences far below lr (1e-2) but environment-dependent (the tiny base's random weights):
    # 5.5e-6 measured once, 3.4e-5 on 2026-12-07 with the same code.
    _assert_same_tensors(_adapter(replicated), _adapter(sharded), atol=1e-4)
    # The output projection's products have other shapes sharded (oneDNN's blocking follows them): a few fp32 ulps
    # (1.2e-7 relative, measured 2026-12-07).
    assert _logged(replicated) == pytest.approx(_logged(sharded), rel=1e-6)

    # The export has the full vocabulary: trained rows where kept, the base's rows elsewhere.
    kept = torch.load(sharded / "kept_ids.pt")
    base_embedding = load_file(base / "model.safetensors")["model.embed_tokens.weight"]
    exported = _merged(sharded)["model.embed_tokens.weight"]
    assert exported.shape == base_embedding.shape == (VOCAB_SIZE, base_embedding.shape[1])
    others = torch.ones(VOCAB_SIZE, dtype=torch.bool)
    others[kept] = False
    assert torch.equal(exported[others], base_embedding[others])
    assert (exported[kept] - base_embedding[kept]).abs().amax(dim=1).min() > 0  # every kept row trained


def _bad_input_worker(rank: int, world_size: int, base: str, tmp: str) -> None:
    from recipes.qlora_finetune_distributed import QLoRAFinetuneRecipeDistributed

    base, tmp = Path(base), Path(tmp)
    (tmp / "out_of_range.json").write_text(json.dumps([0, 1, VOCAB_SIZE + 3]))
    (tmp / "duplicated.json").write_text(json.dumps([0, 1, 5, 1]))
    cases = {
        "fsdp_cpu_offload": (["fsdp_cpu_offload=True"], "needs an accelerator"),
        "global_batch": (["global_batch_size=3"], "cannot be split evenly over 2 ranks"),
        "too_few_samples": (["dataset.num_samples=5"], "fewer than one batch per rank"),
        "too_few_validation_samples": (
            ["dataset_val.num_samples=1", "run_val_every_n_steps=1"],
            "dataset_val has 1 samples, fewer than one per rank",
        ),
        "ids_out_of_range": (
            [f"vocab_pruning.kept_ids={tmp / 'out_of_range.json'}", "vocab_pruning.enabled=True"],
            "outside the vocabulary",
        ),
        "ids_duplicated": (
            [f"vocab_pruning.kept_ids={tmp / 'duplicated.json'}", "vocab_pruning.enabled=True"],
            "duplicated id",
        ),
        "sharding": (["vocab_pruning.enabled=True", "vocab_pruning.sharding=both"], "vocab_pruning.sharding"),
    }
    for name, (extra, message) in cases.items():
        out = tmp / name
        cfg = _recipe_cfg(out, base, extra)
        with pytest.raises(ConfigError, match=message):  # one line, exit code 2 (exit_on_config_error)
            recipe = QLoRAFinetuneRecipeDistributed(cfg)
            recipe.setup(cfg)
        assert not out.exists(), f"{name}: {sorted(p.name for p in out.iterdir())} written before the error"
        dist.barrier()  # the group is still usable: no rank is stuck in a collective
    # the same validation set is no error where validation does not run
    cfg = _recipe_cfg(tmp / "no_validation", base, ["dataset_val.num_samples=1", "run_val_every_n_steps=null"])
    recipe = QLoRAFinetuneRecipeDistributed(cfg)
    recipe.setup(cfg)
    recipe.cleanup()


def _fp16_overflow_worker(rank: int) -> None:
    """An inf in one rank's gradient shard makes every rank skip the step (fp16 loss scaling)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from torchtune_ext.training import DistributedLossScaler

    mesh = init_device_mesh("cpu", (2,))
    sharded = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    replicated = torch.nn.Parameter(torch.ones(3))  # e.g. a replicated vocab-pruning module, next to DTensors
    optimizer = torch.optim.SGD([sharded, replicated], lr=0.5)
    scaler = DistributedLossScaler(enabled=True, device=torch.device("cpu"), init_scale=8.0)
    for overflow in (True, False):
        scaled = float(scaler.scale(torch.ones(())))  # the gradients of a scaled loss whose true gradient is 1
        sharded.grad = distribute_tensor(torch.full((4, 2), scaled), mesh, [Shard(0)])
        replicated.grad = torch.full((3,), scaled)
        if overflow and rank == 1:
            sharded.grad.to_local()[0, 0] = float("inf")
        scaler.unscale_(optimizer)
        taken = scaler.step(optimizer)
        optimizer.zero_grad()
        assert taken is not overflow
        assert scaler.skipped_steps == 1
    # One skipped step (scale 8 halved to 4), then one step with the unscaled gradient 1.
    assert scaler.get_scale() == 4.0
    assert torch.equal(sharded.full_tensor(), torch.full((4, 2), 0.5))
    assert torch.equal(replicated.detach(), torch.full((3,), 0.5))


def _ranks_agree_worker(rank: int, world_size: int, base: str, tmp: str) -> None:
    _bad_input_worker(rank, world_size, base, tmp)
    _fp16_overflow_worker(rank)


def test_ranks_fail_fast_on_bad_input_and_agree_on_fp16_overflow(base, tmp_path):
    run_distributed(_ranks_agree_worker, 2, str(base), str(tmp_path))


def test_cli_error_exits_without_hanging(base, tmp_path):
    out = tmp_path / "out"
    start = time.perf_counter()
    result = _tune_run(_overrides(out, base) + ["global_batch_size=5"])
    output = result.stdout + result.stderr
    assert result.returncode == CONFIG_ERROR_EXIT_CODE, output[-4000:]
    assert "global_batch_size=5 cannot be split evenly over 2 ranks" in output
    assert "Traceback" not in output, output[-4000:]  # neither a rank's nor torchrun's
    assert time.perf_counter() - start < RUN_TIMEOUT_S
    assert not out.exists()


# ------------------------------------------------------------------------------------------------------ configs

_MIRRORED = ("model", "tokenizer", "checkpointer", "dataset", "optimizer", "lr_scheduler", "loss", "dtype", "seed")


@pytest.mark.parametrize("name", ["llama3_1/8B_qlora", "llama2/7B_qlora", "qwen2_5/7B_qlora", "llama3_1/70B_qlora"])
def test_real_model_configs(name):
    from torchtune import config as tune_config

    cfg = OmegaConf.load(ROOT / "configs" / f"{name}.yaml")
    single_path = ROOT / "configs" / f"{name}_single_device.yaml"
    if single_path.is_file():
        # Switching recipes changes the file name only: same model, data, checkpoint and optimisation.
        ours, single = OmegaConf.to_container(cfg), OmegaConf.to_container(OmegaConf.load(single_path))
        for key in _MIRRORED:
            assert ours[key] == single[key], key
    assert cfg.vocab_pruning.enabled is False and cfg.fsdp_cpu_offload is False
    # The architecture builds (on the meta device) with NF4-compatible shapes in the configured dtype.
    model = tune_config.instantiate(cfg.model, dtype=torch.bfloat16, device="meta")
    assert sum(p.numel() for p in model.parameters()) > 1e9


@pytest.mark.stack
def test_two_node_launch_matches_one_node(base, dist_run, tmp_path):
    """Two launchers on this machine, as on two nodes: ``--nnodes 2``, one gloo process per node, c10d rendezvous on
    127.0.0.1 (the README's multi-node command). The same 2-rank job as ``dist_run``: the same losses."""
    from conftest import free_port

    out = tmp_path / "two_nodes"
    launch = [
        str(TUNE),
        "run",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv_id",
        "two_node_test",
        DIST_RECIPE,
        "--config",
        str(CONFIG),
        *_overrides(out, base),
        f"batch_size={PER_RANK_BATCH}",
    ]
    nodes = [
        subprocess.Popen(launch, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=RUN_TIMEOUT_S) for node in nodes]
    for node, (stdout, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, f"a node failed (rc {node.returncode}):\n{stdout[-2000:]}\n{stderr[-6000:]}"
    assert _logged(out) == pytest.approx(_logged(dist_run), abs=1e-6)
    _assert_same_tensors(_adapter(out), _adapter(dist_run), atol=1e-6)
