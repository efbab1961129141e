package api

import (
	"errors"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
)

// peerUID finds the owner of the caller's end of a real loopback
// connection, over IPv4 and (where the host has it) IPv6.
func TestPeerUID(t *testing.T) {
	for _, network := range []string{"tcp4", "tcp6"} {
		t.Run(network, func(t *testing.T) {
			host := "127.0.0.1:0"
			if network == "tcp6" {
				host = "[::1]:0"
			}
			ln, err := net.Listen(network, host)
			if err != nil {
				t.Skipf("no %s loopback: %v", network, err)
			}
			defer ln.Close()
			accepted := make(chan net.Conn, 1)
			go func() {
				c, _ := ln.Accept()
				accepted <- c
			}()
			client, err := net.Dial(network, ln.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer client.Close()
			server := <-accepted
			if server == nil {
				t.Fatal("accept failed")
			}
			defer server.Close()
			c := shmCallerOf(server.RemoteAddr().String(), server.LocalAddr().String())
			if !c.loopback || c.uid != os.Geteuid() {
				t.Errorf("caller = %+v, want loopback uid %d", c, os.Geteuid())
			}
			// The server's own end is not the caller's: the pair is
			// directional.
			if uid, ok := peerUID(server.LocalAddr().String(), "127.0.0.1:1"); ok {
				t.Errorf("an address pair with no connection gave uid %d", uid)
			}
		})
	}
	if c := shmCallerOf("192.0.2.7:5000", "127.0.0.1:8000"); c.loopback || c.uid != -1 {
		t.Errorf("remote caller = %+v", c)
	}
	if c := shmCallerOf("127.0.0.1:40000", ""); !c.loopback || c.uid != -1 {
		t.Errorf("caller without the server's address = %+v, want loopback with no uid", c)
	}
}

func TestParseProcAddr(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"0100007F:1F90", "127.0.0.1:8080"},
		{"00000000000000000000000001000000:0050", "[::1]:80"},
		{"0000000000000000FFFF00000100007F:C350", "127.0.0.1:50000"},
	} {
		got, ok := parseProcAddr(tc.in)
		if !ok || got.String() != tc.want {
			t.Errorf("parseProcAddr(%q) = %v %v, want %s", tc.in, got, ok, tc.want)
		}
	}
	for _, bad := range []string{"", "0100007F", "01007F:1F90", "zz00007F:1F90", "0100007F:10000"} {
		if got, ok := parseProcAddr(bad); ok {
			t.Errorf("parseProcAddr(%q) = %v, want a refusal", bad, got)
		}
	}
}

func TestShmAccess(t *testing.T) {
	const owner = 1000
	for _, tc := range []struct {
		name        string
		mode        uint32
		uid         int
		read, write bool
	}{
		{"root may do anything", 0o600, 0, true, true},
		{"owner by user bits", 0o600, owner, true, true},
		{"owner read-only", 0o400, owner, true, false},
		{"owner without user bits", 0o066, owner, false, false},
		{"stranger on a private object", 0o600, 65534, false, false},
		{"stranger, group bits do not count", 0o660, 65534, false, false},
		{"stranger on a world-readable object", 0o644, 65534, true, false},
		{"stranger on a world-writable object", 0o666, 65534, true, true},
		{"unknown caller is a stranger", 0o600, -1, false, false},
		{"unknown caller, world-readable", 0o604, -1, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := &syscall.Stat_t{Uid: owner, Mode: syscall.S_IFREG | tc.mode}
			if r, w := shmAccess(st, tc.uid); r != tc.read || w != tc.write {
				t.Errorf("uid %d on %#o: read %v write %v, want %v %v", tc.uid, tc.mode, r, w, tc.read, tc.write)
			}
		})
	}
}

// TestSharedMemoryOwnership: the server (root here, as in the issue) maps
// an object only as far as its caller could open it: a private object of
// another user is refused (403), a world-readable one takes inputs but no
// outputs, and nothing is written into an object the caller may not write.
func TestSharedMemoryOwnership(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root, to make objects of other users")
	}
	shm := newTestSharedMemory(t, SharedMemoryOptions{MaxRegions: 8, MaxBytes: 1 << 20})
	nobody := shmCaller{loopback: true, uid: 65534}
	object := func(mode os.FileMode, uid int) string {
		key := shmObject(t, 4096)
		if err := os.Chmod(shmDir+key, mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(shmDir+key, uid, uid); err != nil {
			t.Fatal(err)
		}
		return key
	}

	private := object(0o600, 0)
	for _, c := range []shmCaller{nobody, {loopback: true, uid: -1}} {
		err := shm.Register("", c, "p", private, 0, 8)
		if !errors.Is(err, errForbidden) || !strings.Contains(err.Error(), "may not read it") {
			t.Errorf("root's private object from %+v: %v, want 403", c, err)
		}
	}
	if err := shm.Register("", shmCaller{loopback: true, uid: 0}, "p", private, 0, 8); err != nil {
		t.Errorf("root's private object from root: %v", err)
	}

	readable := object(0o644, 0)
	if err := shm.Register("", nobody, "r", readable, 0, 8); err != nil {
		t.Fatalf("world-readable object: %v", err)
	}
	u := &shmUse{s: shm}
	defer u.release()
	if _, err := u.input("x", "UINT8", []int64{8}, 8, shmParams{region: "r", size: 8}); err != nil {
		t.Errorf("input from a world-readable object: %v", err)
	}
	if _, err := u.output("y", shmParams{region: "r", size: 8}); !errors.Is(err, errForbidden) || !strings.Contains(err.Error(), "read-only") {
		t.Errorf("output into a world-readable object: %v, want 403", err)
	}

	own := object(0o600, 65534)
	if err := shm.Register("", nobody, "o", own, 0, 8); err != nil {
		t.Fatalf("the caller's own object: %v", err)
	}
	if _, err := u.output("y", shmParams{region: "o", size: 8}); err != nil {
		t.Errorf("output into the caller's own object: %v", err)
	}
	shared := object(0o666, 0)
	if err := shm.Register("", nobody, "s", shared, 0, 8); err != nil {
		t.Fatalf("world-writable object: %v", err)
	}
	if _, err := u.output("y", shmParams{region: "s", size: 8}); err != nil {
		t.Errorf("output into a world-writable object: %v", err)
	}
}
