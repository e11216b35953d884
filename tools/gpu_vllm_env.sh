# Sourced by the device scripts (tools/device_*.sh), from the repository root: GPU vLLM 0.24.0 installed from
# /tmp/gpu-vllm (../shared/device/GPU-VLLM.md: carried in parts) and .whl/ (zstandard, and apache-tvm-ffi 0.1.11
# in place of vLLM's pin 0.1.9: the xgrammar beside it needs 0.1.11, and vLLM imports xgrammar at its start) into
# /tmp/site, once per machine; PYTHONPATH set; the GPU, torch and vLLM named. Returns non-zero where that fails.
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
if [ ! -d /tmp/site/vllm ]; then
    cat /tmp/gpu-vllm/part.* > /tmp/all.tar && mkdir -p /tmp/wh && tar xf /tmp/all.tar -C /tmp/wh &&
        rm -f /tmp/wh/apache_tvm_ffi-0.1.9-*.whl &&
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/wh/*.whl \
            .whl/*.whl || { echo "installing GPU vLLM failed"; return 1; }
fi
export PYTHONPATH="/tmp/site:$PWD"
python3 -c "import torch, vllm; print('GPU:', torch.cuda.get_device_name(), '| torch', torch.__version__, '| vLLM', vllm.__version__)"
