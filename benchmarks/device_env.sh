# Sourced by the device scripts (device_session.sh, device_policies.sh) on a lent machine:
# installs the wheels the machine's image lacks from .whl/ when that folder exists
# (transformers 4.x for the Flax GPT-2, HiGHS; see the device tool's README for how they are
# fetched), and sets PYTHONPATH and unbuffered output.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
