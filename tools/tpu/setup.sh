# Sourced on the TPU machine (the `device` tool) from the project's root: `source .whl-tpu/setup.sh && ...`.
# Installs what gemport imports under /tmp, once per machine (a warm machine keeps /tmp), keeping the machine's own
# JAX and libtpu first on PYTHONPATH, and puts the project root on it (gemport is not pip-installed there). No torch:
# a TPU host trains without it; with tools/tpu/prepare.sh --peers, torch's CPU build, TRL, PEFT and accelerate too.
export PIP_CONFIG_FILE=/dev/null PYTHONUNBUFFERED=1
index=(--isolated -q --only-binary=:all: --no-compile --no-cache-dir --index-url file:///opt/pypi/simple)
if [ ! -f /tmp/gemport-site.done ]; then
  python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl-tpu/*.whl 2>&1 | grep -v notice
  python3 -m pip install "${index[@]}" --target /tmp/site2 flax==0.12.8 optax orbax-checkpoint safetensors einops \
    pyyaml absl-py etils dill cloudpickle fsspec huggingface_hub msgpack opt_einsum pillow protobuf rich \
    sentencepiece tqdm wrapt tensorstore googleapis-common-protos attrs filelock transformers tokenizers jinja2 \
    psutil datasets pandas pyarrow 2>&1 | grep -v notice
  if [ -f .whl-tpu/peers ]; then
    python3 -m pip install --isolated -q --no-compile --no-cache-dir --index-url file:///opt/pypi/simple \
      --find-links /opt/wheels --target /tmp/site3 torch==2.13.0 2>&1 | grep -v notice
  fi
  touch /tmp/gemport-site.done
fi
export PYTHONPATH=${PYTHONPATH:-}:/tmp/site:/tmp/site2:/tmp/site3:$PWD
python3 -c 'import jax, gemport.run; print("gemport on", jax.devices()[0].device_kind, "jax", jax.__version__)' \
  2>&1 | grep -v -i "warn"
