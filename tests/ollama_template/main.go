// Renders an Ollama Modelfile's TEMPLATE with Go's text/template, the engine Ollama reads it with, for
// tests/test_ollama_template.py: reads {"template": ..., "messages": [{"role": ..., "content": ...}]} on stdin
// and writes the prompt Ollama would give the model. The data carries the names Ollama's templates see.
package main

import (
	"encoding/json"
	"os"
	"text/template"
)

type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type Values struct {
	Messages []Message
	System   string
	Prompt   string
	Response string
}

func main() {
	var in struct {
		Template string    `json:"template"`
		Messages []Message `json:"messages"`
	}
	if err := json.NewDecoder(os.Stdin).Decode(&in); err != nil {
		panic(err)
	}
	tmpl, err := template.New("").Option("missingkey=zero").Parse(in.Template)
	if err != nil {
		os.Stderr.WriteString("parse: " + err.Error() + "\n")
		os.Exit(3)
	}
	if err := tmpl.Execute(os.Stdout, Values{Messages: in.Messages}); err != nil {
		os.Stderr.WriteString("execute: " + err.Error() + "\n")
		os.Exit(4)
	}
}
