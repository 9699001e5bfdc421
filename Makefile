# The two commands README.md opens with. Each sets up .venv first (idempotent, fast when nothing changed).
.PHONY: demo test setup

demo:
	bash scripts/setup.sh demo
	HF_HUB_OFFLINE=1 WANDB_MODE=offline .venv/bin/vembed demo

test:
	bash scripts/setup.sh dev
	HF_HUB_OFFLINE=1 WANDB_MODE=offline .venv/bin/python -m pytest -q

setup:
	bash scripts/setup.sh dev
