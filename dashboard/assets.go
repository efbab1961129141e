package dashboard

import (
	"embed"
	"io/fs"
)

//go:embed web
var web embed.FS

// Assets are the dashboard page's files (index.html, scripts, styles),
// embedded in the binary so that the page works offline.
func Assets() fs.FS {
	sub, err := fs.Sub(web, "web")
	if err != nil {
		panic(err) // the embedded tree always has web/
	}
	return sub
}
