# The two set-up commands (see README.md). Both install what they need.
.PHONY: demo test bench plugins
demo:
	./scripts/demo.sh
test:
	./scripts/test.sh
plugins:
	./scripts/build-plugins.sh
# Every benchmark case (throughput, ~1M-window checkpoints and recovery, memory per
# window, JSON parsers, Kafka path), one table: scripts/bench.py.
bench: plugins
	CARGO_TARGET_DIR=$${CARGO_TARGET_DIR:-$$HOME/.cache/km0-target} cargo build --release --locked -p km0
	CARGO_TARGET_DIR=$${CARGO_TARGET_DIR:-$$HOME/.cache/km0-target} python3 scripts/bench.py
