"""Test infrastructure: loaded only in processes of pdwatch's live SGLang testbed.

`pdwatch.testbed.sglang_pd` puts this folder on PYTHONPATH for the SGLang servers it
starts on a CPU, and nowhere else; a GPU deployment never sees it.

PyPI's torchvision beside the CPU build of torch fails while registering its
operators (`torchvision::nms does not exist`), and SGLang's scheduler reaches
`import torchvision.transforms`. The servers need none of those operators, so
empty modules stand in for the two registration modules.
"""

import sys
import types

for _name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
    sys.modules.setdefault(_name, types.ModuleType(_name))
