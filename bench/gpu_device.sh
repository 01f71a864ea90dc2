# Runs on the device machine (last call): reassemble the wheels, install jax 0.10.2 + the CUDA 12
# plugin into /tmp/site, move the image's CUDA 13 plugin out of the venv (into /tmp/pure13, used
# only by the jax 0.11.2 runs), then bench/gpu_compare.py device.
SP=/opt/torch/.venv/lib/python3.12/site-packages
if [ ! -d /tmp/site/jax ]; then
  cp .devcarry/p05/* /tmp/parts/
  cat /tmp/parts/bundle.part.* > /tmp/bundle.tar && sha256sum /tmp/bundle.tar | cut -c1-64 && cat .devcarry/code/bundle.sha256
  mkdir -p /tmp/b && tar -C /tmp/b -xf /tmp/bundle.tar
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/b/*.whl 2>&1 | tail -3
  tar -C /tmp/site -xzf /tmp/b/pure.tgz
  mkdir -p /tmp/pure13/jax_plugins /tmp/pure
  mv $SP/jax_plugins/xla_cuda13 /tmp/pure13/jax_plugins/ && mv $SP/jax_cuda13_plugin $SP/jax_cuda13_p*.dist-info /tmp/pure13/
  cp -r /tmp/site/hydra /tmp/site/hydra_core-* /tmp/site/omegaconf /tmp/site/omegaconf-* /tmp/site/antlr4 /tmp/site/antlr4_* /tmp/pure/
fi
export PYTHONPATH=/tmp/site
cd .devcarry/code
# Then one of:
#   python3 bench/gpu_compare.py device ../runs $OUT/cmp   (GPU_COMPARE_B, GPU_COMPARE_ONLY)
PYTHONUNBUFFERED=1 timeout 300 python3 bench/gpu_deviceless_check.py $OUT 2>&1 | grep -v "^I0000\|^WARNING: All log\|^E0000" | cut -c1-400 | tail -30
