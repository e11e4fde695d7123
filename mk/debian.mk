# promtool (Debian's prometheus 2.42) and amtool (prometheus-alertmanager 0.25)
# check and unit-test the alert rules and the Alertmanager example. Installed
# only when missing: CI runs as root on a fresh machine. Debian's packages ship
# services; the install does not start them where policy-rc.d forbids it, and
# the tests start their own processes on loopback ports when they need one.
DEBIAN_TOOLS_STAMP := build/.debian-prometheus-tools

$(DEBIAN_TOOLS_STAMP):
	@if ! command -v promtool >/dev/null 2>&1 || ! command -v amtool >/dev/null 2>&1; then \
	  apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	    prometheus prometheus-alertmanager; \
	fi
	mkdir -p $(@D) && touch $@

TEST_DEPS += $(DEBIAN_TOOLS_STAMP)
DEMO_DEPS += $(DEBIAN_TOOLS_STAMP)
