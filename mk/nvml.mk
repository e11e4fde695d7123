# The NVML stub: libnvidia-ml.so.1 for machines without an NVIDIA GPU, so the
# unmodified nvidia-ml-py (and so the sidecar's GPU sampler) runs against
# values the testbed writes. See nvml_stub/README.md.
NVML_CC   ?= gcc
NVML_STUB := build/nvml/libnvidia-ml.so.1

$(NVML_STUB): nvml_stub/nvml_stub.c mk/nvml.mk
	mkdir -p $(dir $@)
	$(NVML_CC) -std=c11 -D_GNU_SOURCE -O2 -Wall -Wextra -Werror -fPIC -shared \
		-Wl,-soname,libnvidia-ml.so.1 -o $@ $< -lpthread

.PHONY: nvml-stub
nvml-stub: $(NVML_STUB)

TEST_DEPS += $(NVML_STUB)
DEMO_DEPS += $(NVML_STUB)

# This file is read before the Makefile's own rules: keep a bare `make` on the
# Makefile's first target rather than on the stub.
ifeq ($(.DEFAULT_GOAL),$(NVML_STUB))
.DEFAULT_GOAL :=
endif
