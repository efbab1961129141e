package syncbuf

import (
	"fmt"
	"strings"
	"sync"
	"testing"
)

// Writers and a reader at once lose nothing and race on nothing (run
// under -race).
func TestBufferConcurrent(t *testing.T) {
	var b Buffer
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			for i := range 100 {
				fmt.Fprintf(&b, "w%d-%d\n", w, i)
			}
		})
	}
	wg.Go(func() {
		for range 100 {
			_ = b.String()
		}
	})
	wg.Wait()
	if got := strings.Count(b.String(), "\n"); got != 400 {
		t.Errorf("%d lines, want 400", got)
	}
	if !strings.Contains(b.String(), "w3-99\n") {
		t.Error("a write is missing")
	}
}
