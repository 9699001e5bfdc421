# The two commands README.md opens with. Each sets up .venv first (idempotent, fast when nothing changed).
.PHONY: demo test setup mutate gpu-check gpu-wheels reference

demo:
	bash scripts/setup.sh demo
	HF_HUB_OFFLINE=1 WANDB_MODE=offline .venv/bin/vembed demo

test:
	bash scripts/setup.sh dev
	HF_HUB_OFFLINE=1 WANDB_MODE=offline .venv/bin/python -m pytest -q --durations=30

setup:
	bash scripts/setup.sh dev

# Mutation score of one module against its own tests (mutmut, on a copy of the tree):
#   make mutate MODULE=vembed/data/sampler.py TESTS=tests/data/test_sampler.py
mutate:
	bash scripts/setup.sh dev
	bash scripts/mutate.sh $(MODULE) $(TESTS)

# The GPU check (docs/guides/testing.md, "Checking the GPU paths"): on a GPU machine, results in $(OUT) (default runs/gpu-check).
OUT ?= runs/gpu-check
gpu-check:
	bash scripts/gpu_check.sh --out $(OUT)

# Here, before a GPU run: the wheels the GPU machine lacks, into gpu-wheels/ (gitignored; the device tool carries it).
gpu-wheels:
	bash scripts/setup.sh dev
	.venv/bin/python scripts/gpu_wheels.py --out gpu-wheels --python 3.12

# docs/reference/recipe.md from the schema and the components' Settings (tests/test_recipe_reference.py checks it).
reference:
	bash scripts/setup.sh dev
	HF_HUB_OFFLINE=1 .venv/bin/python -m vembed.reference > docs/reference/recipe.md.tmp
	mv docs/reference/recipe.md.tmp docs/reference/recipe.md
