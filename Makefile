# The two commands of the README. Both set up their own virtual environment (.venv).
.PHONY: demo test setup clean

demo: ## set up everything, then run the speculative-decoding restart demo on the file backend
	scripts/setup.sh
	.venv/bin/hicache-draft demo

test: ## set up everything, then lint and run the whole test suite
	scripts/test.sh

setup:
	scripts/setup.sh --test

clean:
	rm -rf .venv
