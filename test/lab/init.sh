#!/bin/busybox sh
# PID 1 of the KVM lab's emulated machine (busybox). It loads KVM and 9p,
# mounts the host's root read-only at /host, chroots into it and runs the KVM
# test files with the host's own node. The host (test/lab/run.ts) watches the
# serial console for the LAB-* lines below; they are its readiness signals.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
# Loopback: tests run servers on 127.0.0.1 inside the lab.
ip link set lo up || ifconfig lo 127.0.0.1 up

fail() {
	echo "LAB-FAIL $*"
	dmesg | tail -n 20 | sed 's/^/kernel: /'
	poweroff -f
}

# Per-run settings (LAB_REPO, LAB_NODE, LAB_PATH, LAB_STORE, LAB_CI, LAB_FILTER,
# LAB_COMMAND, LAB_INNER_TIMEOUT, LAB_KVM_AMD_ARGS), appended to the initramfs by the host.
[ -f /lab.env ] || fail "/lab.env missing from the initramfs"
. /lab.env
echo "LAB-STAGE kernel-up $(cut -d' ' -f1 /proc/uptime)"

for m in $(cat /modules/order); do
	args=
	[ "$m" = kvm_amd ] && args=$LAB_KVM_AMD_ARGS
	# shellcheck disable=SC2086 # (several parameters, split on purpose)
	insmod "/modules/$m.ko" $args || fail "insmod $m $args"
done
[ -c /dev/kvm ] || fail "/dev/kvm did not appear after loading the kvm modules"
kvm_amd_params=
for p in npt vgif vls avic; do
	[ -r "/sys/module/kvm_amd/parameters/$p" ] && kvm_amd_params="$kvm_amd_params $p=$(cat "/sys/module/kvm_amd/parameters/$p")"
done
echo "LAB-STAGE kvm-ready$kvm_amd_params $(cut -d" " -f1 /proc/uptime)"

mkdir -p /host
# cache=loose: the share is read-only and the host leaves it alone during the run.
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=262144 host /host || fail "mount of the host root (9p) failed"
for d in proc sys dev tmp; do
	[ -d "/host/$d" ] || fail "the host has no /$d to mount on"
done
# A second view of the host root that the tmpfs mounts below do not cover: the
# checkout or the store may live under /tmp or /run (CI clones anywhere).
mkdir -p /hostroot
mount -o bind /host /hostroot || fail "bind of the host root failed"
mount -t proc proc /host/proc
mount -t sysfs sysfs /host/sys
# cgroup v2 only, as most hosts now have it (this machine and CI have v1): the
# process engine's v2 path is tested in here (test/kvm/process-cgroup-v2.test.ts).
mount -t cgroup2 cgroup2 /host/sys/fs/cgroup || fail "mount of cgroup2 failed"
mount -t devtmpfs devtmpfs /host/dev
mkdir -p /host/dev/pts /host/dev/shm
mount -t devpts devpts /host/dev/pts
mount -t tmpfs tmpfs /host/dev/shm
mount -t tmpfs -o mode=1777 tmpfs /host/tmp || fail "tmpfs on /tmp"
[ -d /host/run ] && mount -t tmpfs tmpfs /host/run

# The host's store, readable, writable through an overlay whose changes live in
# the lab's /tmp (the outer store is never modified); redirect_dir lets the
# store replace a directory atomically by renames, as it does outside.
STORE=/tmp/forkling-store
if [ -n "$LAB_STORE" ] && [ -d "/hostroot$LAB_STORE" ]; then
	mkdir -p /host/tmp/.lab-store/upper /host/tmp/.lab-store/work
	mkdir -p "/host$LAB_STORE"
	mount -t overlay overlay -o "lowerdir=/hostroot$LAB_STORE,upperdir=/host/tmp/.lab-store/upper,workdir=/host/tmp/.lab-store/work,redirect_dir=on" "/host$LAB_STORE" ||
		fail "overlay on the store $LAB_STORE failed"
	STORE="$LAB_STORE"
else
	echo "LAB-NOTE the store ${LAB_STORE:-(unset)} does not exist on the host; using an empty one in /tmp"
	mkdir -p "/host$STORE"
fi
[ -d "/hostroot$LAB_REPO" ] || fail "the checkout $LAB_REPO is not visible through the host share"
if [ ! -d "/host$LAB_REPO" ]; then
	# hidden below one of the lab's tmpfs mounts: bring it back
	mkdir -p "/host$LAB_REPO"
	mount -o bind "/hostroot$LAB_REPO" "/host$LAB_REPO" || fail "bind of the checkout $LAB_REPO failed"
fi
[ -x "/host$LAB_NODE" ] || fail "node ($LAB_NODE) is not visible through the host share"
echo "LAB-STAGE mounted $(cut -d' ' -f1 /proc/uptime)"

# Kernel messages stay in dmesg while the suite prints (the host parses the console).
dmesg -n 1
# But a CPU stuck in the kernel (soft lockup) reports only its first line at
# that level; where it is stuck (registers, call trace) stays in dmesg. So the
# first three such reports go to the console in full (kernel: ...), from
# whichever CPU is still free: a lab that froze then says where.
(
	seen=0
	while sleep 10; do
		n=$(dmesg | grep -c 'soft lockup')
		[ "$n" -gt "$seen" ] || continue
		[ "$seen" -lt 3 ] && dmesg | awk -v n="$n" '/soft lockup/ { k++ } k == n' | head -n 60 | sed 's/^/kernel: /'
		seen=$n
	done
) &
# A heartbeat from the lab's own shell, not from the suite: while it comes the
# lab's kernel runs, however long a test is quiet; when it stops, the lab froze
# (the runner then boots it again at once, not after the suite's silence limit).
# One write per line: the console's tty never cuts it into another writer's line.
(
	while sleep 20; do
		echo "LAB-BEAT $(cut -d' ' -f1 /proc/uptime)"
	done
) &
dmesg_before=$(dmesg | wc -l)
echo "LAB-NODE-START $(cut -d' ' -f1 /proc/uptime)"
# The host's root becomes the root of a mount namespace of its own (as
# switch_root does), not a chroot: the kernel refuses user namespaces to a
# chrooted process, and the process engine's sandboxes need them.
timeout -s KILL "$LAB_INNER_TIMEOUT" unshare -m /bin/sh -c 'cd /host && mount --move . / && exec chroot . "$@"' lab /usr/bin/env -i \
	PATH="$LAB_PATH" HOME=/tmp TMPDIR=/tmp TERM=dumb LANG=C.UTF-8 \
	CI="$LAB_CI" FORKLING_HOME="$STORE" FORKLING_TEST_FILTER="$LAB_FILTER" FORKLING_IN_LAB=1 \
	LAB_COMMAND="$LAB_COMMAND" /bin/sh -c '
		cd "$1" || exit 1
		[ -z "$LAB_COMMAND" ] && exec "$2" test/run.mjs kvm-direct
		# A command instead of the suite (a benchmark): its exit status is the result.
		/bin/sh -c "$LAB_COMMAND"
		c=$?
		if [ "$c" = 0 ]; then echo "1 passed, 0 failed"; else echo "0 passed, 1 failed"; fi
		exit "$c"' lab "$LAB_REPO" "$LAB_NODE" </dev/null
code=$?
[ "$code" = 137 ] && echo "LAB-TIMEOUT the inner suite ran past ${LAB_INNER_TIMEOUT}s and was killed"
echo "LAB-EXIT $code $(cut -d' ' -f1 /proc/uptime)"
if [ "$code" != 0 ]; then
	echo "kernel messages during the run (last 30):"
	dmesg | tail -n "+$((dmesg_before + 1))" | tail -n 30 | sed 's/^/kernel: /'
fi
echo "LAB-POWEROFF"
poweroff -f
