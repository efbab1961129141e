package dashboard

// ring keeps the last cap values appended to it.
type ring[T any] struct {
	buf   []T
	start int // index of the oldest value
	n     int
}

func newRing[T any](capacity int) *ring[T] {
	return &ring[T]{buf: make([]T, max(capacity, 1))}
}

// push appends v, overwriting the oldest value when full.
func (r *ring[T]) push(v T) {
	if r.n < len(r.buf) {
		r.buf[(r.start+r.n)%len(r.buf)] = v
		r.n++
		return
	}
	r.buf[r.start] = v
	r.start = (r.start + 1) % len(r.buf)
}

// len is the number of values held.
func (r *ring[T]) len() int { return r.n }

// at returns the i-th oldest value held (0 is the oldest).
func (r *ring[T]) at(i int) *T { return &r.buf[(r.start+i)%len(r.buf)] }

// last returns the newest value, or nil when empty.
func (r *ring[T]) last() *T {
	if r.n == 0 {
		return nil
	}
	return r.at(r.n - 1)
}

// reset forgets every value.
func (r *ring[T]) reset() { r.start, r.n = 0, 0 }
