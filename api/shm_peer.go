package api

// Whose objects a caller may register (docs/security.md, "Shared memory").
// The server opens and maps a client's object with the server's own
// permissions, which are often more than the client's (a server running as
// root can open any object in /dev/shm). So the server acts on an object
// only as far as its caller could have: it learns the caller's uid and
// compares it with the object's owner and mode, as the kernel would for
// that user. Over loopback TCP there is no SO_PEERCRED, but the kernel
// knows the owner of the caller's end of the connection: /proc/net/tcp and
// tcp6 list every socket with its uid, the same table identd reads. When
// the caller's end cannot be found there (another network namespace, no
// /proc), the caller is taken to be a stranger: only the object's "others"
// permissions count.

import (
	"bufio"
	"encoding/binary"
	"encoding/hex"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"syscall"
)

// shmCaller is who registers a region, as far as the server can tell.
type shmCaller struct {
	// loopback is whether the caller's peer is on the server's host.
	loopback bool
	// uid owns the caller's end of the connection; -1 when unknown.
	uid int
}

// shmCallerOf describes the caller of a connection from its remote (the
// caller's) and local (the server's) addresses, "host:port".
func shmCallerOf(remote, local string) shmCaller {
	c := shmCaller{loopback: isLoopback(remote), uid: -1}
	if !c.loopback {
		return c
	}
	if uid, ok := peerUID(remote, local); ok {
		c.uid = uid
	}
	return c
}

// procNetTCP are the kernel's tables of TCP sockets.
var procNetTCP = []string{"/proc/net/tcp", "/proc/net/tcp6"}

// peerUID finds the owner of the socket whose local address is remote and
// whose peer is local: the caller's end of a loopback connection.
func peerUID(remote, local string) (int, bool) {
	r, err1 := netip.ParseAddrPort(remote)
	l, err2 := netip.ParseAddrPort(local)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	r = netip.AddrPortFrom(r.Addr().Unmap(), r.Port())
	l = netip.AddrPortFrom(l.Addr().Unmap(), l.Port())
	for _, table := range procNetTCP {
		if uid, ok := findSocketUID(table, r, l); ok {
			return uid, true
		}
	}
	return 0, false
}

// findSocketUID scans one table ("sl local rem st queues tr retr uid ...")
// for the socket from local to rem.
func findSocketUID(table string, local, rem netip.AddrPort) (int, bool) {
	f, err := os.Open(table)
	if err != nil {
		return 0, false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Scan() // the header
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 8 {
			continue
		}
		l, ok1 := parseProcAddr(fields[1])
		r, ok2 := parseProcAddr(fields[2])
		if !ok1 || !ok2 || l != local || r != rem {
			continue
		}
		uid, err := strconv.Atoi(fields[7])
		if err != nil || uid < 0 {
			return 0, false
		}
		return uid, true
	}
	return 0, false
}

// parseProcAddr reads an address of /proc/net/tcp[6]: each 32-bit word of
// the address as the host loads it, in hex, a colon and the port in hex.
func parseProcAddr(s string) (netip.AddrPort, bool) {
	h, p, ok := strings.Cut(s, ":")
	if !ok {
		return netip.AddrPort{}, false
	}
	b, err := hex.DecodeString(h)
	if err != nil || (len(b) != 4 && len(b) != 16) {
		return netip.AddrPort{}, false
	}
	port, err := strconv.ParseUint(p, 16, 16)
	if err != nil {
		return netip.AddrPort{}, false
	}
	for i := 0; i < len(b); i += 4 {
		binary.NativeEndian.PutUint32(b[i:], binary.BigEndian.Uint32(b[i:]))
	}
	addr, ok := netip.AddrFromSlice(b)
	if !ok {
		return netip.AddrPort{}, false
	}
	return netip.AddrPortFrom(addr.Unmap(), uint16(port)), true
}

// shmAccess says whether a caller of uid (-1: unknown) may read and write
// an object of the owner and mode st gives, as the kernel would decide for
// that user. Group permissions are not counted: the server cannot learn the
// caller's groups over TCP. uid 0 may do anything, as root may.
func shmAccess(st *syscall.Stat_t, uid int) (read, write bool) {
	mode := st.Mode
	switch {
	case uid == 0:
		return true, true
	case uid > 0 && uint32(uid) == st.Uid:
		return mode&syscall.S_IRUSR != 0, mode&syscall.S_IWUSR != 0
	}
	return mode&syscall.S_IROTH != 0, mode&syscall.S_IWOTH != 0
}

// netAddrString is a net.Addr as "host:port", "" for nil.
func netAddrString(a net.Addr) string {
	if a == nil {
		return ""
	}
	return a.String()
}
