# Runs on the device machine (last call): reassemble the wheels (jax 0.10.2 + CUDA 12 plugin +
# cuBLAS 12), install into /tmp/site, move the image's CUDA 13 plugin out of the venv (into
# /tmp/pure13), then bench/gpu_compare.py device.
SP=/opt/torch/.venv/lib/python3.12/site-packages
cp .devcarry/p05/* /tmp/parts/
if [ ! -d /tmp/site/jax ]; then
  cat /tmp/parts/bundle.part.* > /tmp/bundle.tar && sha256sum /tmp/bundle.tar | cut -c1-64 && cat .devcarry/code/bundle.sha256
  mkdir -p /tmp/b && tar -C /tmp/b -xf /tmp/bundle.tar
  cat /tmp/parts/cublas.part.* > /tmp/b/nvidia_cublas_cu12-12.9.1.4-py3-none-manylinux_2_27_x86_64.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/b/*.whl 2>&1 | tail -3
  tar -C /tmp/site -xzf /tmp/b/pure.tgz
  mkdir -p /tmp/pure13/jax_plugins /tmp/pure
  mv $SP/jax_plugins/xla_cuda13 /tmp/pure13/jax_plugins/ && mv $SP/jax_cuda13_plugin $SP/jax_cuda13_p*.dist-info /tmp/pure13/
  cp -r /tmp/site/hydra /tmp/site/hydra_core-* /tmp/site/omegaconf /tmp/site/omegaconf-* /tmp/site/antlr4 /tmp/site/antlr4_* /tmp/pure/
fi
ls /tmp/site/nvidia; ls /tmp/site/nvidia/cublas/lib
export PYTHONPATH=/tmp/site
cd .devcarry/code
GPU_COMPARE_B="jax 0.10.2, compiled on the GPU from the same lowering, autotuned||resume|" PYTHONUNBUFFERED=1 timeout 420 python3 bench/gpu_compare.py device ../runs $OUT/cmp 2>&1 | grep "^|"
if grep -q "rc -11" $OUT/cmp/compare.md; then
  JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=gpu_compiler=1,autotuner_util=1,dso_loader=2 PYTHONPATH=.:bench:/tmp/site timeout 120 python3 -m jaxaot.cli.main resume_from=../runs/matmul_bf16_4096 start_at=compile compile.topology=null compile.backend=cuda hydra.run.dir=/tmp/dbg 2>&1 | grep -v "^I0000" | tail -25 | cut -c1-300
fi
for f in $OUT/cmp/transformer*/execute/outputs.npz; do d=$(basename $(dirname $(dirname $f))); cp $f $OUT/$d.npz; done; rm -rf $OUT/cmp/*/; ls $OUT
