# The two set-up commands (see README.md). Both install what they need.
.PHONY: demo test bench plugins release install
demo:
	./scripts/demo.sh
test:
	./scripts/test.sh
plugins:
	./scripts/build-plugins.sh
# The release binary, profile-guided (scripts/build-release.sh, which prints its path;
# KM0_PGO=0: plain).
release: plugins
	./scripts/build-release.sh
# Every benchmark case (throughput, ~1M-window checkpoints and recovery, memory per
# window, JSON parsers, Kafka path) of the release binary, one table: scripts/bench.py.
bench: plugins
	bin=$$(./scripts/build-release.sh) && \
	  KM0_BIN="$$bin" CARGO_TARGET_DIR=$${CARGO_TARGET_DIR:-$$HOME/.cache/km0-target} python3 scripts/bench.py
# km0 on the PATH: the release binary into $(PREFIX)/bin (default ~/.cargo/bin, where
# rustup puts cargo), with the plugins built for the examples.
PREFIX ?= $(HOME)/.cargo
install: plugins
	CARGO_TARGET_DIR=$${CARGO_TARGET_DIR:-$$HOME/.cache/km0-target} cargo install --locked --path host --root "$(PREFIX)" --force
	@echo "km0 installed in $(PREFIX)/bin (put it on your PATH if it is not)"
