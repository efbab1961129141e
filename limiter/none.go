package limiter

import (
	"fmt"
	"sync"
)

// noneLimiter enforces nothing. On CPU its placements still size the
// intra-op thread pool to the share, so that a quarter share at least
// does not start a thread per core.
type noneLimiter struct {
	dev    device
	cpus   int
	reason string

	mu    sync.Mutex
	units unitTable[Share]
}

var _ Limiter = (*noneLimiter)(nil)

func newNone(dev device, cpus int, reason string) *noneLimiter {
	if dev.gpu {
		cpus = 1
	}
	return &noneLimiter{dev: dev, cpus: max(cpus, 1), reason: reason, units: unitTable[Share]{}}
}

func (l *noneLimiter) Kind() string { return KindNone }

func (l *noneLimiter) Describe() string {
	if l.dev.gpu {
		return "none: " + l.reason
	}
	return fmt.Sprintf("none: %s; compute shares set intra-op threads of %d CPUs only", l.reason, l.cpus)
}

func (l *noneLimiter) CPUs() int { return l.cpus }

// Capabilities: nothing enforced, nothing measured.
func (l *noneLimiter) Capabilities() Capabilities { return Capabilities{} }

func (l *noneLimiter) Place(id string, s Share) (Placement, error) {
	if err := validShare(s); err != nil {
		return Placement{}, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.units.free(id); err != nil {
		return Placement{}, err
	}
	l.units[id] = s
	if l.dev.gpu {
		return Placement{}, nil
	}
	return Placement{IntraOpThreads: ThreadsFor(s, l.cpus)}, nil
}

func (l *noneLimiter) Resize(id string, s Share) error {
	if err := validShare(s); err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, err := l.units.get(id); err != nil {
		return err
	}
	l.units[id] = s
	return nil
}

func (l *noneLimiter) Release(id string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, err := l.units.get(id); err != nil {
		return err
	}
	delete(l.units, id)
	return nil
}

func (l *noneLimiter) Stats(id string) (Stats, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, err := l.units.get(id)
	return Stats{}, err
}

func (l *noneLimiter) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	clear(l.units)
	return nil
}
