"""vembed/recipe_checks.py is the one home of the recipe's rules: a recipe error raised anywhere else is either a
component's own check (called from there, in its listed order) or listed below with what it is, so a new rule cannot
quietly start a seventh home."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

import vembed
from vembed import recipe_checks
from vembed.components import recipe_from_dict
from vembed.errors import RecipeError

PACKAGE = Path(vembed.__file__).parent
RECIPE_ERRORS = {"RecipeError", "InvalidKey", "_KeyError"}  # InvalidKey: raised in validators, reported as one
HOMES = {"vembed/recipe.py", "vembed/recipe_checks.py"}  # the schema (stage 1) and every later stage
OWN_CHECKS = {"check_recipe", "check_config"}  # a registered class's own rules, called from the home

# Every other function that raises a recipe error today, by what it is. A new one fails the scan: put a recipe rule in
# vembed/recipe_checks.py (or, when a component owns it, in that component's check_recipe / Settings validators, and
# name it in the home's stage list); add it here only when it is not a rule about the recipe, saying which group.
ELSEWHERE: dict[str, set[str]] = {
    # --- component-owned rules, reached from a stage of the home (listed in its docstring) ---
    "vembed/registry.py": {"Registry.get"},  # stage 1: an unknown name
    "vembed/components.py": {"RegistryCatalog.component"},  # stage 1: an unknown model_type / loss_type
    "vembed/tasks/__init__.py": {"task_name_for",  # stage 2: the model and the loss train the same task
                                 "Task.check_gradient_cache"},  # stage 3: GradCache asked of a per-sample task
    "vembed/tasks/contrastive.py": {"_check_not_streamed", "_check_source_and_stage_keys", "_check_token_vectors",
                                    "_check_sparse",
                                    "_resolve_best_metric", "_check_teacher_embeddings",  # stage 4
                                    "ContrastiveTask.load_train_data"},  # the teacher's rows, as the data is read
    "vembed/classification/task.py": {"class_names"},  # stage 4, ClassificationTask.check_recipe
    "vembed/reranking/task.py": {"_check_evaluation", "_check_held_out"},  # stage 4, RerankTask.check_recipe
    "vembed/reranking/cross_encoder.py": {"CrossEncoderAdapter.settings_of", "CrossEncoderAdapter.hf_config",
                                          "CrossEncoderAdapter.load",  # its check_recipe's; load: a saved folder
                                          "CrossEncoderAdapter.__init__"},  # packing: a head without a layer stack
    "vembed/models/base.py": {"EmbeddingAdapter.settings_of", "require_tokenizer_name",
                              # built-time guard (stage 4 refuses first), and reading saved model folders:
                              "EmbeddingAdapter.set_pixel_budget", "EmbeddingAdapter.saved_settings", "load_adapter",
                              "read_adapter_file"},
    "vembed/models/hf.py": {"require_model_type", "auto_config", "_loading", "resolve_max_length"},  # configs
    "vembed/models/splade.py": {"require_masked_lm",  # embedding: sparse needs an MLM head: the config's rule
                                "weights_from_json"},  # static_query_init: the idf.json's content, when it is read
    "vembed/models/packing.py": {"use_packed_attention"},  # built-time guard behind check_packing (stage 3)
    "vembed/losses/guide.py": {"check_guide_folder", "load_guide"},  # stage 4; load: when the loss is built
    "vembed/generation/dit.py": {"config_from_recipe", "Blip3oDiT.on_meta"},  # stage 4 (flow) and the planner
    "vembed/planning.py": {"choose_gradient_cache", "EncoderShape.from_config"},  # stage 6; the planner's shapes
    # --- the data's readers: stage 4 (files exist) and, naming file and key, as the data is read ---
    "vembed/data/paths.py": {"check_data_paths", "resolve_files", "_resolve_one", "builder_for"},
    "vembed/data/sources.py": {"load_rows", "_load_corpus_pairs"},
    "vembed/data/streaming.py": {"check_stream_recipe", "find_shards", "_check_first_sample"},
    "vembed/data/corpus.py": {"CorpusSource.check"},
    "vembed/data/embedding_shards.py": {"read_index"},
    "vembed/classification/labelled.py": {"read_labelled_images", "_image_folder"},
    "vembed/data/teacher_embeddings.py": {"read_index"},  # loss.teacher_embeddings, the vembed extract folder
    "vembed/extraction.py": {"extract_teacher_embeddings"},  # vembed extract --recipe: its data.train
    # --- output folders (stage 5 and the tools' --out / --cache-dir) ---
    "vembed/training/run_dir.py": {"check_output_dir", "_check_writable"},
    "vembed/files.py": {"check_replaceable", "check_output_file"},
    "vembed/retrieval/cache.py": {"check_cache_folder"},
    # --- guards while building or resuming, behind the stages' refusals (a direct Python caller meets them) ---
    "vembed/models/qwen_vl.py": {"QwenVLModel.__init__", "QwenVLModel._check_token_ids",
                                 "QwenVLModel.planned_document", "set_pixel_budget"},
    "vembed/reranking/qwen_vl_reranker.py": {"QwenVLReranker.__init__"},  # no LM head; a tokenizer without "yes"/"no"
    "vembed/models/text.py": {"TextAdapter.__init__", "TextAdapter.sentence_transformers_modules",
                              "TextAdapter._add_static_query_weight",  # tokenizer and MLM head of one size
                              "TextAdapter.load_static_query_weight"},  # a saved static query encoder's weights
    "vembed/models/token_projection.py": {"TokenVectors.load_projection"},  # a saved multi_vector folder
    "vembed/models/vision.py": {"VisionAdapter.load", "VisionAdapter.classify",
                                "VisionAdapter.head_from_class_names"},  # no class names: the task fills them
    "vembed/models/lora.py": {"inject_lora", "load_lora_weights"},
    "vembed/losses/contrastive.py": {"InfoNCELoss.from_recipe", "SigLIPLoss.from_recipe"},
    "vembed/losses/late_interaction.py": {"LateInteractionLoss.from_recipe"},
    # num_classes, after the task's check
    "vembed/classification/metric_losses.py": {"SubCenterArcFaceLoss.from_recipe"},
    "vembed/classification/pml.py": {"PMLLoss.from_recipe"},  # num_classes of a proxy loss, after the task's check
    # class_weights against the training labels: stage 4 (ClassificationTask.check_recipe) and as the loss is built
    "vembed/classification/losses.py": {"class_weight_tensor"},
    "vembed/training/objective.py": {"parameter_groups"},  # layer_lr_decay on a model stage 6 could not build on meta
    "vembed/training/streamed.py": {"StreamedEpochs._check_compatible"},
    # --- not recipes: saved model folders, and command lines whose flag is not a literal ---
    "vembed/models/foreign.py": {"model_folder", "_read_json", "_sentence_transformers_folder", "_text_adapter",
                                 "load_embedding_model", "require_embedder"},
    "vembed/generation/__init__.py": {"load_generator"},
    "vembed/cli.py": {"_index_command"},
    "vembed/models/token_vectors.py": {"require_single_vector"},  # a dense-only command handed a ColBERT model
    "vembed/retrieval/maxsim_search.py": {"set_pool_factor"},  # --pool-factor, document_pool_factor
    "vembed/entrypoints/evaluate.py": {"_check_flags", "_named_sources", "_check_reranking"},
    "vembed/reranking/__init__.py": {"load_reranker"},  # a saved reranker folder
    "vembed/entrypoints/extract.py": {"run.body", "_mode"},
}


def raise_sites(source: str) -> list[tuple[int, str, bool]]:
    """(line, enclosing function as Class.method, whether the function is a registered check) for every raise of a
    recipe error whose key is not a command-line flag (`"--out"`: a tool's flag, not a recipe key)."""
    found: list[tuple[int, str, bool]] = []

    def visit(node: ast.AST, scope: list[ast.AST]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, [*scope, child])
                continue
            if isinstance(child, ast.Raise) and _is_recipe_error(child.exc):
                found.append((child.lineno, ".".join(s.name for s in scope) or "<module>", _own_check(scope)))
            visit(child, scope)

    visit(ast.parse(source), [])
    return found


def _is_recipe_error(exc: ast.expr | None) -> bool:
    if not (isinstance(exc, ast.Call) and isinstance(exc.func, ast.Name) and exc.func.id in RECIPE_ERRORS):
        return False
    key = exc.args[0] if exc.args else None
    return not (isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value.startswith("--"))


def _own_check(scope: list[ast.AST]) -> bool:
    """A method named check_recipe/check_config of a class, or a pydantic validator (a Settings class's rules)."""
    if not scope or not isinstance(scope[-1], ast.FunctionDef):
        return False
    method = len(scope) > 1 and isinstance(scope[-2], ast.ClassDef)
    validator = any("validator" in ast.unparse(decorator) for decorator in scope[-1].decorator_list)
    return (method and scope[-1].name in OWN_CHECKS) or validator


def stray_raises(sources: dict[str, str]) -> list[str]:
    """'file:line in function' for each recipe error raised outside the homes, the own checks and ELSEWHERE."""
    return [f"{path}:{line} in {function}" for path, source in sorted(sources.items()) if path not in HOMES
            for line, function, own in raise_sites(source)
            if not own and function not in ELSEWHERE.get(path, set())]


def package_sources() -> dict[str, str]:
    return {path.relative_to(PACKAGE.parent).as_posix(): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}


def test_recipe_errors_are_raised_only_where_the_home_says():
    stray = stray_raises(package_sources())
    assert not stray, ("a recipe error raised outside vembed/recipe_checks.py and the components' own checks; put "
                       "the rule there (or list it in ELSEWHERE with what it is):\n" + "\n".join(stray))


def test_every_place_listed_elsewhere_still_raises_one():
    # The list is the map of where recipe errors come from: a place that stopped raising is taken off it.
    sources = package_sources()
    raising = {(path, function) for path, source in sources.items() for _, function, _ in raise_sites(source)}
    stale = sorted(f"{path}: {function}" for path, functions in ELSEWHERE.items() for function in functions
                   if (path, function) not in raising)
    assert not stale, stale


def test_a_stray_raise_is_reported_and_flags_and_own_checks_are_not():
    source = '''
from vembed.errors import RecipeError
def decide(recipe):
    raise RecipeError("batch_size", "a new rule outside the home")
def parse(args):
    raise RecipeError("--out", "a flag, not a recipe key")
class Adapter:
    @classmethod
    def check_recipe(cls, recipe):
        raise RecipeError("pooling", "the adapter's own rule")
'''
    assert stray_raises({"vembed/training/loop.py": source}) == ["vembed/training/loop.py:4 in decide"]
    assert stray_raises({"vembed/recipe_checks.py": source}) == []


def test_the_home_names_every_task_whose_rules_it_calls():
    from vembed.tasks import TASKS

    for name in TASKS.names():
        module = TASKS.get(name).check_recipe.__func__.__module__
        path = module.replace(".", "/") + ".py"
        assert f"`{path}`" in recipe_checks.__doc__, f"{name}'s rules live in {path}: list them in the home"


# --- the stages, called directly --------------------------------------------------------------------------------------

def _promise(command: str | None = "python run.py"):
    from vembed.training.launch_promise import LaunchPromise

    return LaunchPromise(command, None)


def _refusal(recipe, kind="single", on_cpu=True, promise=None) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        recipe_checks.check_launch(recipe, kind, on_cpu=on_cpu, promise=promise or _promise())
    assert "\n" not in str(info.value)
    return info.value


def test_check_keys_wants_training_data_and_installed_trackers(monkeypatch):
    recipe = recipe_from_dict({"report_to": "tensorboard"})
    error = _raised(lambda: recipe_checks.check_keys(recipe))
    assert (error.key, error.message) == ("data.train", "is required for training; point it at a JSONL/CSV/Parquet "
                                                        "file or directory")
    recipe_checks.check_keys(recipe, for_training=False)  # evaluation-only callers need no training data
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    error = _raised(lambda: recipe_checks.check_keys(recipe, for_training=False))
    assert (error.key, error.message) == ("report_to", "tensorboard is not installed; pip install "
                                                       "'vembed[tensorboard]' or remove it")


def test_check_recipe_runs_the_components_before_the_keys_and_the_keys_before_the_task(monkeypatch):
    from vembed.tasks.contrastive import ContrastiveTask

    # No data.train and a loss of another task: the components' rule speaks first.
    error = _raised(lambda: recipe_checks.check_recipe(recipe_from_dict({"loss_type": "flow_matching"})))
    assert error.key == "loss_type" and "flow" in error.message
    monkeypatch.setattr(ContrastiveTask, "check_recipe", classmethod(lambda cls, recipe, **kw: pytest.fail("task")))
    assert _raised(lambda: recipe_checks.check_recipe(recipe_from_dict({}))).key == "data.train"
    calls = []
    monkeypatch.setattr(ContrastiveTask, "check_recipe",
                        classmethod(lambda cls, recipe, for_training: calls.append(for_training)))
    recipe_checks.check_recipe(recipe_from_dict({}), for_training=False)
    assert calls == [False]


def _raised(call) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        call()
    return info.value


def test_fp16_is_refused_on_cpu_only(tiny_clip_recipe):
    recipe = recipe_from_dict(dict(tiny_clip_recipe, mixed_precision="fp16"))
    error = _refusal(recipe)
    assert (error.key, error.message) == ("mixed_precision", "fp16 needs a GPU; use bf16 or no on CPU")
    assert not recipe_checks.check_launch(recipe, "single", on_cpu=False, promise=_promise()).enabled
    recipe_checks.check_launch(recipe_from_dict(dict(tiny_clip_recipe, mixed_precision="bf16")), "single",
                               on_cpu=True, promise=_promise())


@pytest.mark.parametrize("command, says, ends", [
    ("python run.py", "launch with `python run.py RECIPE` on several GPUs, or add --accelerate_config fsdp", ""),
    ("vembed train", "launch with `vembed train RECIPE` on several GPUs, or add --accelerate_config fsdp", ""),
    ("accelerate launch", "launch with `accelerate launch --config_file ", "fsdp.yaml -m vembed.entrypoints.train "
                                                                          "RECIPE`"),
])
def test_use_fsdp_needs_an_fsdp_launch_and_says_how_for_the_command_run(tiny_clip_recipe, command, says, ends):
    recipe = recipe_from_dict(dict(tiny_clip_recipe, use_fsdp=True))
    for kind in ("single", "ddp", "deepspeed"):
        error = _refusal(recipe, kind, promise=_promise(command))
        assert error.key == "use_fsdp" and error.message.startswith("is true but this launch is not FSDP; " + says)
        assert error.message.endswith(ends)
    recipe_checks.check_launch(recipe, "fsdp", on_cpu=True, promise=_promise(command))


def test_fsdp_needs_block_classes_and_only_fsdp_asks(tiny_clip_recipe, monkeypatch):
    from vembed.models.clip import ClipAdapter

    recipe = recipe_from_dict(tiny_clip_recipe)
    recipe_checks.check_launch(recipe, "fsdp", on_cpu=True, promise=_promise())
    monkeypatch.setattr(ClipAdapter, "block_classes", lambda self: set())
    error = _refusal(recipe, "fsdp")
    assert (error.key, error.message) == ("model_type", "the clip adapter names no transformer block class to shard "
                                                        "with FSDP; use DDP (accelerate_configs/ddp.yaml) or "
                                                        "DeepSpeed ZeRO-3")
    for kind in ("single", "ddp", "deepspeed"):
        recipe_checks.check_launch(recipe, kind, on_cpu=True, promise=_promise())
    monkeypatch.setattr("vembed.planning.meta_model", lambda recipe: None)  # not buildable on meta: decided later
    recipe_checks.check_launch(recipe, "fsdp", on_cpu=True, promise=_promise())


def test_the_launch_stage_returns_the_gradient_cache_choice_and_its_refusal(tiny_clip_recipe):
    recipe = recipe_from_dict(dict(tiny_clip_recipe, use_gradient_cache=True))
    assert recipe_checks.check_launch(recipe, "ddp", on_cpu=True, promise=_promise()).enabled
    assert _refusal(recipe, "fsdp").key == "use_gradient_cache"
    # One rule at a time, in the listed order: fp16 before use_fsdp, GradCache before compile.
    both = recipe_from_dict(dict(tiny_clip_recipe, mixed_precision="fp16", use_fsdp=True))
    assert _refusal(both).key == "mixed_precision"
    both = recipe_from_dict(dict(tiny_clip_recipe, use_gradient_cache=True, compile=True))
    assert _refusal(both, "deepspeed").key == "use_gradient_cache"


def test_compile_is_refused_where_it_is_not_verified(tiny_clip_recipe, monkeypatch):
    import shutil

    import torch._dynamo

    recipe = recipe_from_dict(dict(tiny_clip_recipe, compile=True))
    for kind, name in (("fsdp", "FSDP"), ("deepspeed", "DeepSpeed")):
        error = _refusal(recipe, kind)
        assert (error.key, error.message) == ("compile", f"is not available under {name}: their hooks gather and "
                                                         "free each tower's weights around its forward, which "
                                                         "compiled towers are not verified against; use DDP, or "
                                                         "compile: false")
    monkeypatch.delenv("CXX", raising=False)  # unset: g++ is the compiler looked for
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "g++" else real_which(name, *a, **k))
    assert "no C++ compiler (g++) is installed" in _refusal(recipe, "ddp", on_cpu=True).message
    monkeypatch.setenv("CXX", "no-such-compiler++")
    error = _refusal(recipe, "ddp", on_cpu=True)
    assert (error.key, error.message) == ("compile", "torch.compile on CPU builds C++ kernels, and no C++ compiler "
                                                     "(no-such-compiler++) is installed; install one (e.g. apt-get "
                                                     "install g++) or use compile: false")
    recipe_checks.check_launch(recipe, "ddp", on_cpu=False, promise=_promise())  # a GPU build needs no C++ compiler
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    error = _refusal(recipe, "single", on_cpu=False)
    assert (error.key, error.message) == ("compile", "torch.compile does not support this Python/torch build; use "
                                                     "compile: false")
    dit = recipe_from_dict({"model_type": "blip3o_dit", "loss_type": "flow_matching", "compile": True,
                            "metric_for_best_model": "image_cosine"})
    error = _refusal(dit)
    assert (error.key, error.message) == ("compile", "model_type blip3o_dit names no encoder towers to compile")


def test_layer_lr_decay_needs_parameter_names_that_say_their_block():
    import torch

    from vembed.components import recipe_from_dict
    from vembed.recipe_checks import check_layer_lr_decay

    recipe = recipe_from_dict({"layer_lr_decay": 0.7})
    with pytest.raises(RecipeError, match="layer_lr_decay: no parameter name of model_type 'clip'"):
        check_layer_lr_decay(recipe, torch.nn.Sequential(torch.nn.Linear(2, 2)))
    blocks = torch.nn.Module()
    blocks.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    check_layer_lr_decay(recipe, blocks)  # `layers.0.weight`: a block index
    check_layer_lr_decay(recipe, None)  # no meta build: the optimizer's guard decides


def test_gradient_cache_asked_of_a_per_sample_task_is_one_rule_for_the_run_and_the_plan():
    """Every task without a batch-wide loss refuses use_gradient_cache with its own reason, through
    Task.check_gradient_cache: the same line from the run's checks and from `vembed plan`'s rule."""
    from types import SimpleNamespace

    from vembed.components import recipe_from_dict
    from vembed.planning import choose_gradient_cache
    from vembed.tasks import TASKS

    per_sample = [TASKS.get(name) for name in TASKS.names() if not TASKS.get(name).uses_gradient_cache]
    assert {task.name for task in per_sample} >= {"classification", "metric_learning", "rerank", "flow_matching"}
    for task in per_sample:
        with pytest.raises(RecipeError) as info:
            task.check_gradient_cache(SimpleNamespace(use_gradient_cache=True))
        assert info.value.key == "use_gradient_cache" and task.no_gradient_cache in str(info.value)
        task.check_gradient_cache(SimpleNamespace(use_gradient_cache=None))  # unset or false: nothing asked
    vit = {"model_type": "vit", "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
           "num_attention_heads": 4, "image_size": 32, "patch_size": 8}
    recipe = recipe_from_dict({"model_type": "vision", "model_config": vit, "loss_type": "cross_entropy",
                               "metric_for_best_model": "accuracy", "use_gradient_cache": True})
    with pytest.raises(RecipeError, match="use_gradient_cache: is not supported for classification; remove it"):
        choose_gradient_cache(recipe, "ddp")
