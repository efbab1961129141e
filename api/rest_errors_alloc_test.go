package api

import (
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/gin-gonic/gin"

	"github.com/sloserve/sloserve/qos"
)

// TestRESTRefusalLogCost: a refusal (here 429, overloaded) logged at debug
// costs nothing while debug is off: writeError allocates no more than
// writing the same answer does. (It built the record's arguments, a slice
// of eight values and the boxed status, for every refusal of a flood.) With
// debug on, the refusal is logged.
func TestRESTRefusalLogCost(t *testing.T) {
	gin.SetMode(gin.ReleaseMode)
	refusal := fmt.Errorf("%w: the queue is full", qos.ErrOverloaded)
	w := httptest.NewRecorder()
	c, _ := gin.CreateTestContext(w)
	c.Request = httptest.NewRequest(http.MethodPost, "/v2/models/m/infer", nil)
	status, _ := statusOf(refusal)
	if status != http.StatusTooManyRequests {
		t.Fatalf("the refusal's status is %d, want 429", status)
	}
	answer := func() {
		w.Body.Reset()
		c.Writer.Header().Del("Content-Type")
	}
	quiet := &restServer{logger: slog.New(slog.NewTextHandler(discard{}, &slog.HandlerOptions{Level: slog.LevelInfo}))}
	written := testing.AllocsPerRun(200, func() { answer(); quiet.writeErrorStatus(c, status, refusal.Error()) })
	logged := testing.AllocsPerRun(200, func() { answer(); quiet.writeError(c, refusal) })
	t.Logf("allocations per refusal: %.1f writing the answer, %.1f through writeError with debug off", written, logged)
	if logged > written {
		t.Errorf("writeError with debug off allocates %.1f per refusal, over the %.1f of writing its answer", logged, written)
	}

	var lines countWriter
	loud := &restServer{logger: slog.New(slog.NewTextHandler(&lines, &slog.HandlerOptions{Level: slog.LevelDebug}))}
	loud.writeError(c, refusal)
	if lines.n != 1 {
		t.Errorf("with debug on, %d log lines for a refusal, want 1", lines.n)
	}
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

// countWriter counts the log lines written to it.
type countWriter struct{ n int }

func (w *countWriter) Write(p []byte) (int, error) { w.n++; return len(p), nil }
