# Headless Chromium and its driver for the browser tests of the live page
# (tests/ui): Debian's `chromium` and `chromium-driver`, so Selenium Manager
# never downloads a browser or a driver. Installed only when missing, as root
# on a fresh machine, like mk/debian.mk's Prometheus tools.
BROWSER_STAMP := build/.debian-chromium

$(BROWSER_STAMP):
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then \
	  apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	    chromium chromium-driver; \
	fi
	mkdir -p $(@D) && touch $@

TEST_DEPS += $(BROWSER_STAMP)
