# Sourced on the GPU machine after scripts/gpu/install.sh:  source scripts/gpu/env.sh
# GPU_PREFIX (default /tmp) must match the one install.sh used.
_p=${GPU_PREFIX:-/tmp}
export PYTHONPATH=$_p/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_USE_FLASHINFER_SAMPLER=0          # else the sampler imports flashinfer, which is not carried
export VLLM_HOST_IP=127.0.0.1 MC_TCP_BIND_ADDRESS=127.0.0.1 MOONCAKE_REQUESTER_LOCAL_HOSTNAME=127.0.0.1
export MOONCAKE_CONFIG_PATH=${MOONCAKE_CONFIG_PATH:-$_p/mc/config.json}   # written by mc_up.sh
export MCBIN=${MCBIN:-$_p/site/mooncake}     # mooncake_master, mooncake_client
# libcudart.so.13 (Mooncake's cuda13 build needs it): the torch venv's nvidia/cu13/lib
if [ -z "${CUDART_DIR:-}" ] || [ ! -e "$CUDART_DIR/libcudart.so.13" ]; then
  CUDART_DIR=
  for _d in /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib \
            /opt/torch/.venv/lib/python3*/site-packages/nvidia/cuda_runtime/lib \
            /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -e "$_d/libcudart.so.13" ] && { CUDART_DIR=$_d; break; }
  done
  [ -n "$CUDART_DIR" ] || CUDART_DIR=$(dirname "$(find /opt /usr/local -name 'libcudart.so.13' 2>/dev/null | head -1)" 2>/dev/null)
fi
export CUDART_DIR
case ":${LD_LIBRARY_PATH:-}:" in
  *":$_p/xlib:"*) ;;
  *) export LD_LIBRARY_PATH=$_p/xlib${CUDART_DIR:+:$CUDART_DIR}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} ;;
esac
unset _p _d
