package api

// Triton's system shared-memory extension. A client on the server's host
// creates a POSIX shared-memory object (/dev/shm/<key>), registers a part
// of it as a named region, and then names a region, offset and size in an
// input's or requested output's parameters: the input's bytes are read
// from the region and the output's bytes are written into it, so tensors
// never pass through the socket. The request tensor is a slice of the
// mapping marked runtime.Tensor.Mapped: the client may truncate the object
// under it at any time, so the server reads it only through runtime's
// fault-guarded copy (into a runner's arena, a batch, or its own memory
// before ONNX Runtime runs in this process), and a fault fails that
// request alone (runtime.ErrMappedFault: 400 / INVALID_ARGUMENT).
//
// The model of who may do what (docs/security.md):
//   - Registering, unregistering and listing regions, and naming them in a
//     request, are inference-level calls. Registration is also refused from
//     a peer that is not loopback: the key names an object on the server's
//     host, which only a process there can have made, and a network client
//     must not make the server map objects of the host it did not create.
//   - The server maps an object only as far as the caller could open it:
//     the caller's uid (from the kernel's table of the loopback
//     connection, shm_peer.go) against the object's owner and mode. A
//     region the caller may read but not write takes inputs only.
//   - Regions belong to the credential that registered them: the admin
//     token, the inference token, or none (when no inference token is
//     configured). Each has its own namespace: a region registered with one
//     cannot be seen, used or unregistered with another. Clients that share
//     a token share its regions.
//   - limits.max_shared_memory_regions and limits.max_shared_memory_bytes
//     bound the regions and the bytes mapped at once; 0 regions turns the
//     extension off.
//
// A region stays mapped while a request uses it: every request takes a
// reference on each region it names and drops it when its response has
// been written, and unregistering drops the registry's own. The last
// reference unmaps the region by putting a placeholder of anonymous zero
// pages over it, so that an execution that outlives its
// request (one whose client went away while the model ran) reads zeros,
// never unmapped memory; the placeholder is freed a grace period later, or
// at Close.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unicode/utf8"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/metadata"

	"github.com/sloserve/sloserve/runtime"
)

// Errors of the shared-memory extension; statusOf maps them.
var (
	// errSharedMemoryUnknown marks a region name that the caller has not
	// registered (400 / NOT_FOUND; in an inference request it is wrapped
	// in errBadRequest: INVALID_ARGUMENT).
	errSharedMemoryUnknown = errors.New("unknown shared memory region")
	// errSharedMemoryLimit marks a registration over the configured
	// limits (400 / RESOURCE_EXHAUSTED).
	errSharedMemoryLimit = errors.New("shared memory limit reached")
	// errForbidden marks a call the caller may not make from where it is
	// (403 / PERMISSION_DENIED).
	errForbidden = errors.New("forbidden")
)

// Names of the tensor parameters of the shared-memory extensions.
const (
	paramShmRegion = "shared_memory_region"
	paramShmOffset = "shared_memory_offset"
	paramShmSize   = "shared_memory_byte_size"
)

// shmDir is where POSIX shared-memory objects live on Linux.
const shmDir = "/dev/shm"

// shmPlaceholderGrace is how long the zero pages put over an unmapped
// region stay before they are freed: far longer than an execution takes
// to notice that its request was cancelled.
const shmPlaceholderGrace = time.Minute

// Bounds on names.
const (
	maxShmNameBytes = 256
	maxShmKeyBytes  = 255 // NAME_MAX
)

// SharedMemoryOptions configure the system shared-memory extension.
type SharedMemoryOptions struct {
	// MaxRegions caps the regions registered at once, over all
	// credentials; 0 turns the extension off.
	MaxRegions int
	// MaxBytes caps the bytes mapped at once, regions unregistered while
	// a request still used them included.
	MaxBytes int64
	// Auth tells whose a call is (see the file comment); nil puts every
	// caller in one namespace.
	Auth *Auth
	// Registerer, when set, gets the gauges of regions registered and
	// bytes mapped.
	Registerer prometheus.Registerer
}

// SharedMemory is the registry of client shared-memory regions, shared by
// the REST and gRPC handlers. Its zero value is not usable; a nil
// *SharedMemory is the extension turned off.
type SharedMemory struct {
	opts SharedMemoryOptions
	page int

	mu           sync.Mutex
	spaces       map[string]map[string]*shmRegion // credential -> name -> region
	regions      int                              // registered now
	mapped       int64                            // bytes mapped now
	placeholders map[*shmPlaceholder]struct{}
	closed       bool
}

// shmRegion is one registered region and its mapping.
type shmRegion struct {
	name, key    string
	offset, size uint64
	file         *os.File // kept open: a truncated object is caught before use
	// writable says an output may be written here: the caller that
	// registered it may write the object, and so may the server's user.
	writable bool
	mapping  []byte // the whole mapping, from a page boundary
	data     []byte // the region's bytes within mapping
	// refs is the registry's reference while registered plus one per
	// request using the region; the last one unmaps it.
	refs atomic.Int64
}

// shmPlaceholder is the anonymous mapping left where a region was.
type shmPlaceholder struct {
	mem   []byte
	timer *time.Timer
}

// NewSharedMemory returns the registry, or nil (the extension off) when
// opts.MaxRegions is 0.
func NewSharedMemory(opts SharedMemoryOptions) (*SharedMemory, error) {
	if opts.MaxRegions <= 0 {
		return nil, nil
	}
	s := &SharedMemory{
		opts:         opts,
		page:         os.Getpagesize(),
		spaces:       map[string]map[string]*shmRegion{},
		placeholders: map[*shmPlaceholder]struct{}{},
	}
	if reg := opts.Registerer; reg != nil {
		for _, g := range []prometheus.Collector{
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "sloserve_shared_memory_regions",
				Help: "System shared-memory regions clients have registered (limits.max_shared_memory_regions).",
			}, func() float64 { n, _ := s.Mapped(); return float64(n) }),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "sloserve_shared_memory_mapped_bytes",
				Help: "Bytes of client shared-memory regions mapped, regions unregistered while a request still used them included (limits.max_shared_memory_bytes).",
			}, func() float64 { _, b := s.Mapped(); return float64(b) }),
		} {
			if err := reg.Register(g); err != nil {
				return nil, fmt.Errorf("api: registering shared memory metrics: %w", err)
			}
		}
	}
	return s, nil
}

// extensionsOf lists the extensions to advertise in server metadata.
func extensionsOf(s *SharedMemory) []string {
	ext := slices.Clone(Extensions)
	if s != nil {
		ext = append(ext, "system_shared_memory")
	}
	return ext
}

// errSharedMemoryOff is the answer to every shared-memory call when the
// extension is off.
func errSharedMemoryOff() error {
	return fmt.Errorf("%w: system shared memory is turned off on this server (limits.max_shared_memory_regions is 0)", errBadRequest)
}

// errCUDASharedMemory is the answer to a CUDA shared-memory registration.
// The other CUDA calls answer as Triton does on a host without GPUs
// (server src/shared_memory_manager.cc: GetStatus, UnregisterHelper): the
// status of all regions is an empty list, the status of a named one is
// errCUDARegionUnknown, and unregistering (all, or by name) succeeds with
// nothing to do, which is what every tritonclient shared-memory example
// calls first to clean up.
func errCUDASharedMemory() error {
	return fmt.Errorf("%w: CUDA shared memory is not supported: sloserve runs models on the CPU and has no GPU memory to share; "+
		"use system shared memory (/v2/systemsharedmemory, SystemSharedMemoryRegister)", errBadRequest)
}

// errCUDARegionUnknown is the status of a named CUDA region: none is ever
// registered. Triton's words first.
func errCUDARegionUnknown(name string) error {
	return fmt.Errorf("%w: Unable to find cuda shared memory region: '%s' (sloserve registers no CUDA shared memory)",
		errSharedMemoryUnknown, clipValue(name))
}

// principal names the credential of a call from its Authorization value:
// "admin", "inference" or "" (no token, or no access control).
func (a *Auth) principal(header string) string {
	if a == nil {
		return ""
	}
	token, ok := bearer(header)
	if !ok {
		return ""
	}
	switch a.state.Load().match(token) {
	case matchAdmin:
		return "admin"
	case matchInference:
		return "inference"
	}
	return ""
}

// grpcAuthHeader is the authorization metadata of a gRPC call.
func grpcAuthHeader(ctx context.Context) string {
	if v := metadata.ValueFromIncomingContext(ctx, "authorization"); len(v) == 1 {
		return v[0]
	}
	return ""
}

// RegionStatus describes one registered region.
type RegionStatus struct {
	Name     string `json:"name"`
	Key      string `json:"key"`
	Offset   uint64 `json:"offset"`
	ByteSize uint64 `json:"byte_size"`
}

// checkShmName checks a region name.
func checkShmName(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("%w: a shared memory region needs a name", errBadRequest)
	case len(name) > maxShmNameBytes:
		return fmt.Errorf("%w: shared memory region name has %d bytes, at most %d are allowed", errBadRequest, len(name), maxShmNameBytes)
	case !utf8.ValidString(name) || strings.ContainsFunc(name, func(r rune) bool { return r < 0x20 || r == 0x7f }):
		return fmt.Errorf("%w: shared memory region name %q holds invalid UTF-8 or control characters", errBadRequest, clipValue(name))
	}
	return nil
}

// shmPath checks a key (a POSIX shared-memory name: "/name" or "name") and
// returns the file it names.
func shmPath(key string) (string, error) {
	name := strings.TrimPrefix(key, "/")
	switch {
	case name == "":
		return "", fmt.Errorf("%w: key must name a POSIX shared memory object, such as \"/input0\"", errBadRequest)
	case len(name) > maxShmKeyBytes:
		return "", fmt.Errorf("%w: key has %d bytes, at most %d are allowed", errBadRequest, len(name), maxShmKeyBytes)
	case strings.ContainsAny(name, "/\x00"), name == ".", name == "..":
		return "", fmt.Errorf("%w: key %q is not a POSIX shared memory name: it must be one path component under %s", errBadRequest, clipValue(key), shmDir)
	}
	return shmDir + "/" + name, nil
}

// Register maps byteSize bytes at offset of the object key as the region
// name of the caller whose Authorization value is authHeader. caller says
// whether the caller's peer is on the server's host and, when known, its
// uid: the object must be one that uid may read (shmAccess); the region is
// writable (an output may go there) only when it may also write it.
func (s *SharedMemory) Register(authHeader string, caller shmCaller, name, key string, offset, byteSize uint64) error {
	if s == nil {
		return errSharedMemoryOff()
	}
	if !caller.loopback {
		return fmt.Errorf("%w: shared memory regions can be registered only from the server's host (a loopback address): the key names an object there", errForbidden)
	}
	if err := checkShmName(name); err != nil {
		return err
	}
	path, err := shmPath(key)
	if err != nil {
		return err
	}
	switch {
	case byteSize == 0:
		return fmt.Errorf("%w: region %q: byte_size must be > 0", errBadRequest, name)
	case byteSize > math.MaxInt64 || offset > math.MaxInt64-byteSize:
		return fmt.Errorf("%w: region %q: offset %d + byte_size %d is beyond any object's size", errBadRequest, name, offset, byteSize)
	}
	who := s.opts.Auth.principal(authHeader)

	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.closed:
		return fmt.Errorf("%w: the server is stopping", errBadRequest)
	case s.spaces[who][name] != nil:
		return fmt.Errorf("%w: shared memory region %q is already registered; unregister it first", errBadRequest, name)
	case s.regions >= s.opts.MaxRegions:
		return fmt.Errorf("%w: %d regions are registered, the limit (limits.max_shared_memory_regions); unregister one first", errSharedMemoryLimit, s.regions)
	case int64(byteSize) > s.opts.MaxBytes-s.mapped:
		return fmt.Errorf("%w: region %q of %d bytes would take the bytes mapped over the limit of %d (limits.max_shared_memory_bytes; %d mapped)",
			errSharedMemoryLimit, name, byteSize, s.opts.MaxBytes, s.mapped)
	}
	r, err := s.mapRegion(path, name, key, offset, byteSize, caller.uid)
	if err != nil {
		return err
	}
	if s.spaces[who] == nil {
		s.spaces[who] = map[string]*shmRegion{}
	}
	s.spaces[who][name] = r
	s.regions++
	s.mapped += int64(byteSize)
	return nil
}

// mapRegion opens and maps a region for a caller of uid (-1: unknown).
func (s *SharedMemory) mapRegion(path, name, key string, offset, byteSize uint64, uid int) (*shmRegion, error) {
	// O_NOFOLLOW: a symbolic link in /dev/shm could point anywhere;
	// O_NONBLOCK: opening a FIFO must not wait for a writer. An object the
	// server's user may only read is opened read-only: its region takes
	// inputs only.
	const flags = syscall.O_NOFOLLOW | syscall.O_NONBLOCK
	f, err := os.OpenFile(path, os.O_RDWR|flags, 0)
	serverWrites := err == nil
	if errors.Is(err, os.ErrPermission) {
		f, err = os.OpenFile(path, os.O_RDONLY|flags, 0)
	}
	if err != nil {
		var why string
		switch {
		case errors.Is(err, syscall.ELOOP):
			why = "is a symbolic link, which is refused"
		case errors.Is(err, os.ErrNotExist):
			why = "does not exist; create it (shm_open) before registering"
		case errors.Is(err, os.ErrPermission):
			why = "cannot be opened by the server's user"
		default:
			why = "cannot be opened: " + errors.Unwrap(err).Error()
		}
		return nil, fmt.Errorf("%w: region %q: key %q (%s) %s", errBadRequest, name, clipValue(key), path, why)
	}
	fail := func(format string, args ...any) (*shmRegion, error) {
		f.Close()
		return nil, fmt.Errorf("%w: region %q: key %q: %s", errBadRequest, name, clipValue(key), fmt.Sprintf(format, args...))
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		return fail("%v", err)
	}
	if st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		return fail("%s is not a regular file (mode %#o)", path, st.Mode)
	}
	read, write := shmAccess(&st, uid)
	if !read {
		f.Close()
		who := "a caller the server cannot identify (only the object's permissions for others count)"
		if uid >= 0 {
			who = fmt.Sprintf("the caller (uid %d)", uid)
		}
		return nil, fmt.Errorf("%w: region %q: key %q: the object belongs to uid %d with mode %#o, and %s may not read it; "+
			"the server maps only objects its caller could open itself", errForbidden, name, clipValue(key), st.Uid, st.Mode&0o7777, who)
	}
	if uint64(st.Size) < offset+byteSize { // no overflow: both are checked below MaxInt64
		return fail("offset %d + byte_size %d is beyond the object's %d bytes", offset, byteSize, st.Size)
	}
	prot := unix.PROT_READ
	if write && serverWrites {
		prot |= unix.PROT_WRITE
	}
	start := offset &^ uint64(s.page-1)
	length := offset + byteSize - start
	if length > math.MaxInt {
		return fail("the region is too large to map")
	}
	mem, err := unix.Mmap(int(f.Fd()), int64(start), int(length), prot, unix.MAP_SHARED)
	if err != nil {
		return fail("mmap: %v", err)
	}
	r := &shmRegion{
		name: name, key: key, offset: offset, size: byteSize, file: f,
		writable: prot&unix.PROT_WRITE != 0,
		mapping:  mem,
		data:     mem[offset-start : offset-start+byteSize : offset-start+byteSize],
	}
	r.refs.Store(1)
	return r, nil
}

// Status describes the caller's regions (name "" for all of them, by
// name), or fails with errSharedMemoryUnknown.
func (s *SharedMemory) Status(authHeader, name string) ([]RegionStatus, error) {
	if s == nil {
		return nil, errSharedMemoryOff()
	}
	who := s.opts.Auth.principal(authHeader)
	s.mu.Lock()
	defer s.mu.Unlock()
	space := s.spaces[who]
	if name != "" {
		r := space[name]
		if r == nil {
			return nil, fmt.Errorf("%w: no region named %q is registered", errSharedMemoryUnknown, clipValue(name))
		}
		return []RegionStatus{r.status()}, nil
	}
	out := make([]RegionStatus, 0, len(space))
	for _, r := range space {
		out = append(out, r.status())
	}
	slices.SortFunc(out, func(a, b RegionStatus) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

func (r *shmRegion) status() RegionStatus {
	return RegionStatus{Name: r.name, Key: r.key, Offset: r.offset, ByteSize: r.size}
}

// Unregister removes one of the caller's regions (name "" for all of them).
// A region a request is using stays mapped until the request ends.
func (s *SharedMemory) Unregister(authHeader, name string) error {
	if s == nil {
		return errSharedMemoryOff()
	}
	who := s.opts.Auth.principal(authHeader)
	s.mu.Lock()
	space := s.spaces[who]
	var gone []*shmRegion
	if name != "" {
		r := space[name]
		if r == nil {
			s.mu.Unlock()
			return fmt.Errorf("%w: no region named %q is registered", errSharedMemoryUnknown, clipValue(name))
		}
		delete(space, name)
		gone = append(gone, r)
	} else {
		for _, r := range space {
			gone = append(gone, r)
		}
		delete(s.spaces, who)
	}
	s.regions -= len(gone)
	s.mu.Unlock()
	for _, r := range gone {
		s.release(r)
	}
	return nil
}

// release drops a reference to r; the last one unmaps it.
func (s *SharedMemory) release(r *shmRegion) {
	if r.refs.Add(-1) != 0 {
		return
	}
	r.file.Close()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.mapped -= int64(r.size)
	if s.closed {
		_ = unix.Munmap(r.mapping)
		return
	}
	// Zero pages over the region, in one step (MAP_FIXED replaces the
	// mapping): a late reader sees zeros, never a hole.
	_, err := unix.MmapPtr(-1, 0, unsafe.Pointer(unsafe.SliceData(r.mapping)), uintptr(len(r.mapping)),
		unix.PROT_READ|unix.PROT_WRITE, unix.MAP_FIXED|unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		_ = unix.Munmap(r.mapping)
		return
	}
	p := &shmPlaceholder{mem: r.mapping}
	s.placeholders[p] = struct{}{}
	p.timer = time.AfterFunc(shmPlaceholderGrace, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if _, ok := s.placeholders[p]; ok {
			delete(s.placeholders, p)
			_ = unix.Munmap(p.mem)
		}
	})
}

// Close unregisters every region and unmaps what is mapped. Requests must
// have ended; registrations after Close fail.
func (s *SharedMemory) Close() {
	if s == nil {
		return
	}
	s.mu.Lock()
	s.closed = true
	var gone []*shmRegion
	for _, space := range s.spaces {
		for _, r := range space {
			gone = append(gone, r)
		}
	}
	clear(s.spaces)
	s.regions = 0
	for p := range s.placeholders {
		p.timer.Stop()
		_ = unix.Munmap(p.mem)
	}
	clear(s.placeholders)
	s.mu.Unlock()
	for _, r := range gone {
		s.release(r)
	}
}

// Mapped reports the regions registered and the bytes mapped.
func (s *SharedMemory) Mapped() (regions int, bytes int64) {
	if s == nil {
		return 0, 0
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.regions, s.mapped
}

// shmUse is what one inference request holds of the regions it names:
// each region acquired once, all released together when the request's
// response has been written. The zero value (or one over a nil registry)
// refuses every use.
type shmUse struct {
	s          *SharedMemory
	authHeader string
	// httpReq is the REST request, checked once for having been sent by a
	// web page of another site (Auth.sharedMemoryBrowserCheck); nil for
	// gRPC, which browsers cannot speak.
	httpReq *http.Request
	checked bool
	held    []*shmRegion
}

// shmParams are a tensor's shared-memory parameters.
type shmParams struct {
	region       string
	offset, size uint64
}

// shmTarget is a requested output to be written into a region.
type shmTarget struct {
	name   string // the output
	params shmParams
	dst    []byte
}

// acquire takes a reference to the caller's region name, once per request.
func (u *shmUse) acquire(name string) (*shmRegion, error) {
	if u == nil || u.s == nil {
		return nil, errSharedMemoryOff()
	}
	for _, r := range u.held {
		if r.name == name {
			return r, nil
		}
	}
	if u.httpReq != nil && !u.checked {
		if ref := u.s.opts.Auth.sharedMemoryBrowserCheck(u.httpReq, false); ref != nil {
			return nil, fmt.Errorf("%w: %s", errForbidden, ref.msg)
		}
		u.checked = true
	}
	who := u.s.opts.Auth.principal(u.authHeader)
	u.s.mu.Lock()
	r := u.s.spaces[who][name]
	if r != nil {
		r.refs.Add(1) // the registry's reference keeps it above 0 here
	}
	u.s.mu.Unlock()
	if r == nil {
		return nil, fmt.Errorf("%w: %w: no region named %q is registered", errBadRequest, errSharedMemoryUnknown, clipValue(name))
	}
	u.held = append(u.held, r)
	return r, nil
}

// release drops the request's references.
func (u *shmUse) release() {
	if u == nil {
		return
	}
	for _, r := range u.held {
		u.s.release(r)
	}
	u.held = nil
}

// slice returns the bytes of a tensor's parameters within its region,
// after checking them against what was registered and that the object
// has not been truncated under the mapping.
func (u *shmUse) slice(kind, tensor string, p shmParams) ([]byte, error) {
	r, err := u.acquire(p.region)
	if err != nil {
		return nil, fmt.Errorf("%s %q: %w", kind, tensor, err)
	}
	if kind == "output" && !r.writable {
		return nil, fmt.Errorf("%w: output %q: region %q is read-only: the caller that registered it, or the server's user, may not write its object (key %q)",
			errForbidden, tensor, p.region, clipValue(r.key))
	}
	if p.size > r.size || p.offset > r.size-p.size {
		return nil, fmt.Errorf("%w: %s %q: shared_memory_offset %d + shared_memory_byte_size %d is beyond region %q of %d bytes",
			errBadRequest, kind, tensor, p.offset, p.size, p.region, r.size)
	}
	st, err := r.file.Stat()
	if err != nil || uint64(st.Size()) < r.offset+r.size {
		return nil, fmt.Errorf("%w: %s %q: the object of region %q (key %q) has been truncated under the region; register it again",
			errBadRequest, kind, tensor, p.region, clipValue(r.key))
	}
	end := p.offset + p.size
	return r.data[p.offset:end:end], nil
}

// input reads an input's data from its region: the tensor aliases the
// mapping (the caller marks it runtime.Tensor.Mapped). Its byte size must be what the shape and datatype say; BYTES
// elements are length-prefixed as in Triton (a 4-byte little-endian length
// before each element).
func (u *shmUse) input(name string, dt runtime.DataType, shape []int64, n int64, p shmParams) ([]byte, error) {
	data, err := u.slice("input", name, p)
	if err != nil {
		return nil, err
	}
	if dt != runtime.Bytes {
		if want := dt.ByteSize(n); int64(p.size) != want {
			return nil, fmt.Errorf("%w: input %q: shared_memory_byte_size is %d but shape %v of %s needs %d bytes",
				errBadRequest, name, p.size, shape, dt, want)
		}
		return data, nil
	}
	err = shmGuard(func() error {
		err := runtime.CheckBytes(data, n)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("%w: input %q: shared memory data: %v", errBadRequest, name, err)
	}
	return data, nil
}

// output checks a requested output's region and returns where it goes.
func (u *shmUse) output(name string, p shmParams) (shmTarget, error) {
	dst, err := u.slice("output", name, p)
	if err != nil {
		return shmTarget{}, err
	}
	return shmTarget{name: name, params: p, dst: dst}, nil
}

// write copies an output tensor into its region and returns the bytes
// written. An output larger than the region is a bad request: the client
// sized the region.
func (t *shmTarget) write(out *runtime.Tensor) (int, error) {
	if _, err := checkOutputTensor(out); err != nil {
		return 0, err
	}
	if len(out.Data) > len(t.dst) {
		return 0, fmt.Errorf("%w: output %q has %d bytes (shape %v of %s) but its shared memory region %q gives %d (shared_memory_byte_size)",
			errBadRequest, out.Name, len(out.Data), out.Shape, out.DataType, t.params.region, len(t.dst))
	}
	err := shmGuard(func() error { copy(t.dst, out.Data); return nil })
	if err != nil {
		return 0, fmt.Errorf("%w: output %q: %w", errBadRequest, out.Name, err)
	}
	return len(out.Data), nil
}

// shmGuard runs f, which touches a mapping, and turns a memory fault (the
// client truncated its object under the mapping: SIGBUS) into an error
// rather than a crash of the server (runtime.GuardMapped).
func shmGuard(f func() error) error {
	var err error
	if fault := runtime.GuardMapped(func() { err = f() }); fault != nil {
		return fault
	}
	return err
}
