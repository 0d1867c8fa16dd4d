# The two set-up commands (see README.md). Both install what they need.
.PHONY: demo test bench plugins
demo:
	./scripts/demo.sh
test:
	./scripts/test.sh
plugins:
	./scripts/build-plugins.sh
bench: plugins
	cargo build --release --locked -p km0
	$${CARGO_TARGET_DIR:-$$HOME/.cache/km0-target}/release/km0 bench examples/stock-alert/pipeline.toml --events 1000000
