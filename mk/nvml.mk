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

# The stub under AddressSanitizer + UBSan, then ThreadSanitizer, with a
# stress run of concurrent readers and a rewriting writer.
.PHONY: nvml-stub-check
nvml-stub-check:
	mkdir -p build/nvml
	$(NVML_CC) -std=c11 -D_GNU_SOURCE -g -O1 -Wall -Wextra -Werror -fsanitize=address,undefined \
		-fno-sanitize-recover=all -o build/nvml/stress-asan nvml_stub/stress_test.c nvml_stub/nvml_stub.c -lpthread
	$(NVML_CC) -std=c11 -D_GNU_SOURCE -g -O1 -Wall -Wextra -Werror -fsanitize=thread \
		-o build/nvml/stress-tsan nvml_stub/stress_test.c nvml_stub/nvml_stub.c -lpthread
	PDWATCH_NVML_STUB_STATE=build/nvml/stress-state build/nvml/stress-asan
	TSAN_OPTIONS=halt_on_error=1 PDWATCH_NVML_STUB_STATE=build/nvml/stress-state build/nvml/stress-tsan

# This file is read before the Makefile's own rules: keep a bare `make` on the
# Makefile's first target rather than on the stub.
ifeq ($(.DEFAULT_GOAL),$(NVML_STUB))
.DEFAULT_GOAL :=
endif
