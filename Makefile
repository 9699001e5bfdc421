# The two commands README.md opens with. Each sets up .venv first (idempotent, fast when nothing changed).
.PHONY: demo test setup mutate

demo:
	bash scripts/setup.sh demo
	HF_HUB_OFFLINE=1 WANDB_MODE=offline .venv/bin/vembed demo

test:
	bash scripts/setup.sh dev
	HF_HUB_OFFLINE=1 WANDB_MODE=offline .venv/bin/python -m pytest -q

setup:
	bash scripts/setup.sh dev

# Mutation score of one module against its own tests (mutmut, on a copy of the tree):
#   make mutate MODULE=vembed/data/sampler.py TESTS=tests/data/test_sampler.py
mutate:
	bash scripts/setup.sh dev
	bash scripts/mutate.sh $(MODULE) $(TESTS)
