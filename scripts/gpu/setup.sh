# Sourced at the start of every device run (scripts/gpu/README.md): the wheels the image lacks (.whl/, carried),
# the checkout on PYTHONPATH, then facts about the machine.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, transformers, flask, pydantic; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cap', torch.cuda.get_device_capability())"
