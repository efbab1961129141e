package api

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestRESTAdminFromBrowsers: admin calls a web page could make through the
// user's browser (cross-site, DNS rebinding, a text/plain "simple" POST)
// are refused in the API's own error shape; the same calls from curl and
// same-origin pages go through, and inference calls are not affected.
func TestRESTAdminFromBrowsers(t *testing.T) {
	const unload = "/v2/repository/models/sum/unload"
	noToken := AuthOptions{AllowedHosts: []string{"sloserve.internal", "Box.Example."}}
	adminToken := AuthOptions{AdminToken: testAdminToken}
	bearer := []string{"Authorization", "Bearer " + testAdminToken}
	cases := []struct {
		name         string
		opts         AuthOptions
		method, path string
		body         string
		header       []string
		want         int
		reason       string
	}{
		{"curl, no Origin", noToken, "POST", unload, "", nil, 200, ""},
		{"curl to localhost", noToken, "POST", unload, "", []string{"Host", "localhost:8000"}, 200, ""},
		{"curl to [::1]", noToken, "POST", unload, "", []string{"Host", "[::1]:8000"}, 200, ""},
		{"curl to an allowed name", noToken, "POST", unload, "", []string{"Host", "sloserve.internal:8000"}, 200, ""},
		{"allowed name, case and dot", noToken, "POST", unload, "", []string{"Host", "box.example.:8000"}, 200, ""},
		{"curl with a JSON body", noToken, "POST", unload, `{}`, nil, 200, ""},
		{"JSON with charset", noToken, "POST", unload, `{}`, []string{"Content-Type", "application/json; charset=utf-8"}, 200, ""},
		{"same-origin page", noToken, "POST", unload, "", []string{"Origin", "http://127.0.0.1:8000", "Sec-Fetch-Site", "same-origin"}, 200, ""},
		{"same origin, default port", noToken, "POST", unload, "", []string{"Host", "localhost", "Origin", "http://localhost"}, 200, ""},
		{"typed into the address bar", noToken, "POST", unload, "", []string{"Sec-Fetch-Site", "none"}, 200, ""},

		{"the probe: evil page, rebound name, text/plain", noToken, "POST", unload, "x",
			[]string{"Origin", "http://evil.example", "Host", "evil.example:8000", "Content-Type", "text/plain"}, 403, authCrossSite},
		{"cross-site Origin", noToken, "POST", unload, "", []string{"Origin", "http://evil.example"}, 403, authCrossSite},
		{"Origin of another port", noToken, "POST", unload, "", []string{"Origin", "http://127.0.0.1:3000"}, 403, authCrossSite},
		{"Origin null", noToken, "POST", unload, "", []string{"Origin", "null"}, 403, authCrossSite},
		{"two Origins", noToken, "POST", unload, "", []string{"Origin", "http://127.0.0.1:8000", "Origin", "http://evil.example"}, 403, authCrossSite},
		{"Sec-Fetch-Site cross-site", noToken, "POST", unload, "", []string{"Sec-Fetch-Site", "cross-site"}, 403, authCrossSite},
		{"Sec-Fetch-Site same-site", noToken, "POST", unload, "", []string{"Sec-Fetch-Site", "same-site"}, 403, authCrossSite},
		{"rebound name, no Origin", noToken, "POST", unload, "", []string{"Host", "evil.example:8000"}, 403, authHostNotAllowed},
		{"rebound name, matching Origin", noToken, "POST", unload, "",
			[]string{"Host", "evil.example:8000", "Origin", "http://evil.example:8000"}, 403, authHostNotAllowed},
		// Triton's clients send no Content-Type (tritonclient.http) or
		// not JSON (tritonclient.http.aio), and no Origin or Sec-Fetch-*.
		{"tritonclient.http: body without a type", noToken, "POST", unload, `{"parameters": {"unload_dependents": false}}`,
			[]string{"Content-Type", "", "User-Agent", "python/gevent-http-client-2.0"}, 200, ""},
		{"tritonclient.http.aio: text/plain", noToken, "POST", "/v2/repository/models/sum/load", `{}`,
			[]string{"Content-Type", "text/plain; charset=utf-8", "User-Agent", "Python/3.12 aiohttp/3.9.5"}, 200, ""},
		{"tool, form type", noToken, "POST", "/v2/config/reload", "a=b", []string{"Content-Type", "application/x-www-form-urlencoded"}, 200, ""},
		// A browser's non-JSON body is refused even from the same origin.
		{"same-origin page, text/plain body", noToken, "POST", unload, "x",
			[]string{"Content-Type", "text/plain", "Origin", "http://localhost:8000", "Host", "localhost:8000"}, 415, authContentType},
		{"form body, Fetch Metadata only", noToken, "POST", "/v2/config/reload", "a=b",
			[]string{"Content-Type", "application/x-www-form-urlencoded", "Sec-Fetch-Mode", "navigate"}, 415, authContentType},
		{"same-origin body without a type", noToken, "POST", unload, "{}", []string{"Content-Type", "", "Sec-Fetch-Site", "same-origin"}, 415, authContentType},
		{"share pin as text, same origin", noToken, "PUT", "/v2/models/sum/share", `{"compute":0.5}`,
			[]string{"Content-Type", "text/plain", "Sec-Fetch-Site", "same-origin"}, 415, authContentType},
		{"share unpin cross-site", noToken, "DELETE", "/v2/models/sum/share", "", []string{"Sec-Fetch-Site", "cross-site"}, 403, authCrossSite},
		{"load cross-site", noToken, "POST", "/v2/repository/models/sum/load", "", []string{"Origin", "https://evil.example"}, 403, authCrossSite},

		// With an admin token the Host is not checked (a page cannot send
		// the token), but browsers are still kept out.
		{"token, any Host", adminToken, "POST", unload, "", append([]string{"Host", "sloserve.example.com"}, bearer...), 200, ""},
		{"token, cross-site", adminToken, "POST", unload, "", append([]string{"Origin", "http://evil.example"}, bearer...), 403, authCrossSite},
		{"token, text/plain from a tool", adminToken, "POST", unload, "{}", append([]string{"Content-Type", "text/plain"}, bearer...), 200, ""},
		{"token, text/plain from a page", adminToken, "POST", unload, "x",
			append([]string{"Content-Type", "text/plain", "Sec-Fetch-Site", "same-origin"}, bearer...), 415, authContentType},
		// A missing token is reported first.
		{"no token, cross-site", adminToken, "POST", unload, "", []string{"Origin", "http://evil.example"}, 401, ""},

		// Inference and read-only calls are not admin calls.
		{"infer cross-site", noToken, "POST", "/v2/models/sum/infer",
			`{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}`,
			[]string{"Origin", "http://evil.example", "Host", "evil.example:8000"}, 200, ""},
		{"index cross-site", noToken, "POST", "/v2/repository/index", "", []string{"Sec-Fetch-Site", "cross-site"}, 200, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			a, _ := newTestAuth(t, c.opts)
			w := serveREST(t, a, c.method, c.path, c.body, loopbackPeer, c.header...)
			if w.Code != c.want {
				t.Fatalf("%d %s, want %d", w.Code, w.Body, c.want)
			}
			if c.want >= 400 {
				checkRefusalBody(t, w)
			}
			if c.reason != "" {
				if n := testutil.ToFloat64(a.failures.WithLabelValues("rest", "admin", c.reason)); n != 1 {
					t.Errorf("sloserve_auth_failures_total{reason=%q} = %v, want 1", c.reason, n)
				}
			}
		})
	}
}
